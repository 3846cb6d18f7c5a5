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
  std::vector<int> archs;
};

template <class Launcher> struct Entry {
  ArchFamily family;
  DType dtype;
  int head_dim;
  Launcher launcher;
};

const std::vector<Family>& families() {
#define FLASH_CUDA_FAMILY(id, name, min_arch, end_arch, ...) \
  Family{ArchFamily::id, name, min_arch, end_arch, {__VA_ARGS__}},
  static const std::vector<Family> table = {
#include "generated/family_table.inc"
  };
#undef FLASH_CUDA_FAMILY
  return table;
}

#define FLASH_CUDA_FWD_KERNEL(family, dtype, hdim, run) \
  Entry<FwdLauncher>{ArchFamily::family, DType::dtype, hdim, FwdLauncher{run}},
#define FLASH_CUDA_BWD_KERNEL(family, dtype, hdim, workspace_bytes, run) \
  Entry<BwdLauncher>{ArchFamily::family, DType::dtype, hdim, BwdLauncher{workspace_bytes, run}},

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

const char* op_name(Op op) { return op == Op::kFwd ? "fwd" : "bwd"; }

const char* dtype_name(DType dtype) { return dtype == DType::kBFloat16 ? "bfloat16" : "float16"; }

std::string arch_text(int sm) { return std::to_string(sm / 10) + "." + std::to_string(sm % 10); }

// Whether code compiled for `archs` runs on `sm`: machine code for sm_X runs on a device of the
// same major version with minor >= X's, and the PTX embedded for the newest arch is compiled by
// the driver for any newer GPU.
bool runs_on(const Family& f, int sm) {
  if (sm < f.min_arch || sm >= f.end_arch || f.archs.empty()) return false;
  return std::any_of(f.archs.begin(), f.archs.end(),
                     [sm](int a) { return a / 10 == sm / 10 && a <= sm; }) ||
         sm > f.archs.back();
}

std::string compiled_families() {
  std::string names;
  for (const Family& f : families()) names += (names.empty() ? "" : ", ") + std::string(f.name);
  return names.empty() ? "none" : names;
}

// The family for `sm`, or nullptr with *error set.
const Family* family_for(int sm, std::string* error) {
  if (sm < 80) {
    *error = "flash_cuda needs a GPU of compute capability 8.0 or newer (Ampere, Hopper, ...); "
             "this one is " + arch_text(sm);
    return nullptr;
  }
  const char* forced = std::getenv("FLASH_CUDA_FAMILY");
  if (forced != nullptr && *forced != '\0') {
    for (const Family& f : families()) {
      if (std::strcmp(f.name, forced) == 0 && runs_on(f, sm)) return &f;
    }
    *error = std::string("FLASH_CUDA_FAMILY=") + forced + " names no kernel family this build " +
             "holds for compute capability " + arch_text(sm) + " (compiled families: " +
             compiled_families() + ")";
    return nullptr;
  }
  for (const Family& f : families()) {
    if (runs_on(f, sm)) return &f;
  }
  std::string list;
  for (const Family& f : families()) {
    for (int a : f.archs) list += (list.empty() ? "" : ", ") + std::to_string(a);
  }
  *error = "flash_cuda was not compiled for this GPU (compute capability " + arch_text(sm) +
           "; compiled archs: " + (list.empty() ? "none" : list) +
           "); rebuild with FLASH_CUDA_ARCHS including " + std::to_string(sm);
  return nullptr;
}

template <class Launcher>
KernelChoice<Launcher> find(Op op, int sm, DType dtype, int head_dim) {
  KernelChoice<Launcher> choice;
  const Family* family = family_for(sm, &choice.error);
  if (family == nullptr) return choice;
  choice.family = family->name;
  const Entry<Launcher>* best = nullptr;
  std::string available;  // built only for the error message
  for (const Entry<Launcher>& e : table(static_cast<Launcher*>(nullptr))) {
    if (e.family != family->id || e.dtype != dtype) continue;
    available += (available.empty() ? "" : ", ") + std::to_string(e.head_dim);
    if (e.head_dim >= head_dim && (best == nullptr || e.head_dim < best->head_dim)) best = &e;
  }
  if (best == nullptr) {
    choice.error = std::string("flash_cuda was built without a ") + op_name(op) +
                   " kernel for head dim " +
                   std::to_string(head_dim) + " in " + dtype_name(dtype) + " (family " +
                   family->name + "; compiled head dims: " +
                   (available.empty() ? "none" : available) +
                   "); rebuild with FLASH_CUDA_HDIMS including a head dim >= " +
                   std::to_string(head_dim) +
                   (op == Op::kBwd ? " and without FLASH_CUDA_DISABLE_BACKWARD" : "");
    return choice;
  }
  choice.launcher = best->launcher;
  choice.head_dim = best->head_dim;
  return choice;
}

}  // namespace

KernelChoice<FwdLauncher> find_fwd(int sm, DType dtype, int head_dim) {
  return find<FwdLauncher>(Op::kFwd, sm, dtype, head_dim);
}
KernelChoice<BwdLauncher> find_bwd(int sm, DType dtype, int head_dim) {
  return find<BwdLauncher>(Op::kBwd, sm, dtype, head_dim);
}

}  // namespace flash_cuda
