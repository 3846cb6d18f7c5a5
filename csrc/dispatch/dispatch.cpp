// The dispatch tables: the manifest's generated lists of families and kernels, searched once per
// call.
#include "dispatch/dispatch.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace flash_cuda {
namespace {

// A compiled kernel family: the archs its units were compiled for, the compute capabilities it
// can serve [min_arch, end_arch), in the manifest's preference order (first is preferred).
struct Family {
  ArchFamily id;
  const char* name;
  int min_arch, end_arch;
  bool arch_specific;  // sm_XXa code only: runs on exactly those archs
  std::vector<int> archs;
};

template <class Launcher> struct Entry {
  ArchFamily family;
  DType dtype;
  int head_dim;
  Launcher launcher;
};

const std::vector<Family>& families() {
#define FLASH_CUDA_FAMILY(id, name, min_arch, end_arch, arch_specific, ...) \
  Family{ArchFamily::id, name, min_arch, end_arch, arch_specific, {__VA_ARGS__}},
  static const std::vector<Family> table = {
#include "generated/family_table.inc"
  };
#undef FLASH_CUDA_FAMILY
  return table;
}

#define FLASH_CUDA_FWD_KERNEL(family, dtype, hdim, supports, workspace_bytes, run)           \
  Entry<FwdLauncher>{ArchFamily::family, DType::dtype, hdim,                                \
                     FwdLauncher{supports, workspace_bytes, run}},
#define FLASH_CUDA_BWD_KERNEL(family, dtype, hdim, workspace_bytes, run) \
  Entry<BwdLauncher>{ArchFamily::family, DType::dtype, hdim, BwdLauncher{workspace_bytes, run}},
#define FLASH_CUDA_FWD_KVCACHE_KERNEL(family, dtype, hdim, supports, workspace_bytes, run, \
                                      num_splits)                                       \
  Entry<KvcacheLauncher>{ArchFamily::family, DType::dtype, hdim,                            \
                         KvcacheLauncher{supports, workspace_bytes, run, num_splits}},

const std::vector<Entry<FwdLauncher>>& table(FwdLauncher*) {
  static const std::vector<Entry<FwdLauncher>> entries = {
#include "generated/fwd_kernel_table.inc"
  };
  return entries;
}

const std::vector<Entry<BwdLauncher>>& table(BwdLauncher*) {
  static const std::vector<Entry<BwdLauncher>> entries = {
#include "generated/bwd_kernel_table.inc"
  };
  return entries;
}

const std::vector<Entry<KvcacheLauncher>>& table(KvcacheLauncher*) {
  static const std::vector<Entry<KvcacheLauncher>> entries = {
#include "generated/fwd_kvcache_kernel_table.inc"
  };
  return entries;
}

const char* op_name(Op op) {
  return op == Op::kFwd ? "fwd" : op == Op::kBwd ? "bwd" : "fwd_kvcache";
}

const char* dtype_name(DType dtype) { return dtype == DType::kBFloat16 ? "bfloat16" : "float16"; }

std::string arch_text(int sm) { return std::to_string(sm / 10) + "." + std::to_string(sm % 10); }

// Whether code compiled for `archs` runs on `sm`: machine code for sm_X runs on a device of the
// same major version with minor >= X's, and the PTX embedded for the newest arch is compiled by
// the driver for any newer GPU.  Arch-specific code (sm_90a) runs on its arch only.
bool runs_on(const Family& f, int sm) {
  if (sm < f.min_arch || sm >= f.end_arch || f.archs.empty()) return false;
  if (f.arch_specific) return std::find(f.archs.begin(), f.archs.end(), sm) != f.archs.end();
  return std::any_of(f.archs.begin(), f.archs.end(),
                     [sm](int a) { return a / 10 == sm / 10 && a <= sm; }) ||
         sm > f.archs.back();
}

std::string compiled_families() {
  std::string names;
  for (const Family& f : families()) names += (names.empty() ? "" : ", ") + std::string(f.name);
  return names.empty() ? "none" : names;
}

// The families to try for `sm`, in order, or none with *error set: FLASH_CUDA_FAMILY's first
// when it is set, then the portable family (the manifest's last); else every family that
// serves `sm`, in preference order.
std::vector<const Family*> families_for(int sm, std::string* error) {
  std::vector<const Family*> order;
  if (sm < 80) {
    *error = "flash_cuda needs a GPU of compute capability 8.0 or newer (Ampere, Hopper, ...); "
             "this one is " + arch_text(sm);
    return order;
  }
  const char* forced = std::getenv("FLASH_CUDA_FAMILY");
  const bool is_forced = forced != nullptr && *forced != '\0';
  for (const Family& f : families()) {
    if (!runs_on(f, sm)) continue;
    if (!is_forced || std::strcmp(f.name, forced) == 0) order.push_back(&f);
  }
  if (is_forced) {
    if (order.empty()) {
      const auto named = std::find_if(families().begin(), families().end(), [&](const Family& f) {
        return std::strcmp(f.name, forced) == 0;
      });
      *error = std::string("FLASH_CUDA_FAMILY=") + forced +
               (named == families().end()
                    ? " names no kernel family this build holds"
                    : " names a compiled family that does not run on this GPU") +
               " (compute capability " + arch_text(sm) + "; compiled families: " +
               compiled_families() + ")";
      return order;
    }
    const Family& portable = families().back();
    if (order.front() != &portable && runs_on(portable, sm)) order.push_back(&portable);
    return order;
  }
  if (order.empty()) {
    std::vector<int> archs;
    for (const Family& f : families()) archs.insert(archs.end(), f.archs.begin(), f.archs.end());
    std::sort(archs.begin(), archs.end());
    archs.erase(std::unique(archs.begin(), archs.end()), archs.end());
    std::string list;
    for (int a : archs) list += (list.empty() ? "" : ", ") + std::to_string(a);
    *error = "flash_cuda was not compiled for this GPU (compute capability " + arch_text(sm) +
             "; compiled archs: " + (list.empty() ? "none" : list) +
             "); rebuild with FLASH_CUDA_ARCHS including " + std::to_string(sm);
  }
  return order;
}

bool takes(const FwdLauncher& l, const FwdParams& p) {
  return l.supports == nullptr || l.supports(p);
}
bool takes(const BwdLauncher&, const BwdParams&) { return true; }
bool takes(const KvcacheLauncher& l, const KvcacheParams& p) {
  return l.supports == nullptr || l.supports(p);
}

// FLASH_CUDA_FAMILY_STRICT=1 (for tests): the family FLASH_CUDA_FAMILY names must take every
// problem it holds a kernel for; a decline is an error instead of a quiet fallback.  (An op it
// has no kernel for, such as sm90's backward, still runs on the portable family.)
bool strict_family() {
  const char* strict = std::getenv("FLASH_CUDA_FAMILY_STRICT");
  return strict != nullptr && std::strcmp(strict, "1") == 0;
}

template <class Launcher, class Params>
KernelChoice<Launcher> find(Op op, int sm, DType dtype, const Params& params, int head_dim) {
  KernelChoice<Launcher> choice;
  const char* forced = std::getenv("FLASH_CUDA_FAMILY");
  for (const Family* family : families_for(sm, &choice.error)) {
    const Entry<Launcher>* best = nullptr;
    std::string available;  // built only for the error message
    for (const Entry<Launcher>& e : table(static_cast<Launcher*>(nullptr))) {
      if (e.family != family->id || e.dtype != dtype) continue;
      available += (available.empty() ? "" : ", ") + std::to_string(e.head_dim);
      if (e.head_dim >= head_dim && (best == nullptr || e.head_dim < best->head_dim)) best = &e;
    }
    if (best != nullptr && takes(best->launcher, params)) {
      choice.launcher = best->launcher;
      choice.family = family->name;
      choice.head_dim = best->head_dim;
      choice.error.clear();
      return choice;
    }
    if (best != nullptr && forced != nullptr && std::strcmp(forced, family->name) == 0 &&
        strict_family()) {
      choice.family = family->name;
      choice.error = std::string("FLASH_CUDA_FAMILY=") + forced + " with " +
                     "FLASH_CUDA_FAMILY_STRICT=1: its " + op_name(op) + " kernel for head dim " +
                     std::to_string(best->head_dim) + " declines this problem (tensors it " +
                     "cannot address, or a tile larger than the block's shared memory)";
      return choice;
    }
    // The message names the last family tried: the portable one, which takes every problem.
    choice.family = family->name;
    choice.error = std::string("flash_cuda was built without a ") + op_name(op) +
                   " kernel for head dim " + std::to_string(head_dim) + " in " +
                   dtype_name(dtype) + " (family " + family->name + "; compiled head dims: " +
                   (available.empty() ? "none" : available) +
                   "); rebuild with FLASH_CUDA_HDIMS including a head dim >= " +
                   std::to_string(head_dim) +
                   (op == Op::kBwd         ? " and without FLASH_CUDA_DISABLE_BACKWARD"
                    : op == Op::kFwdKvcache ? " and without FLASH_CUDA_DISABLE_KVCACHE"
                                            : "");
  }
  return choice;
}

}  // namespace

KernelChoice<FwdLauncher> find_fwd(int sm, DType dtype, const FwdParams& params) {
  return find<FwdLauncher>(Op::kFwd, sm, dtype, params, params.head_dim);
}
KernelChoice<BwdLauncher> find_bwd(int sm, DType dtype, const BwdParams& params) {
  return find<BwdLauncher>(Op::kBwd, sm, dtype, params, params.fwd.head_dim);
}
KernelChoice<KvcacheLauncher> find_fwd_kvcache(int sm, DType dtype, const KvcacheParams& params) {
  return find<KvcacheLauncher>(Op::kFwdKvcache, sm, dtype, params, params.fwd.head_dim);
}

}  // namespace flash_cuda
