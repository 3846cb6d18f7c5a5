// The dispatch table: the manifest's generated list of kernels, searched once per call.
#include "dispatch/dispatch.h"

#include <algorithm>
#include <cstring>

namespace flash_cuda {
namespace {

// One compiled kernel as the dispatcher looks it up.
struct KernelKey {
  const char* direction;
  ArchFamily family;
  DType dtype;
  int head_dim;
};

struct TableEntry {
  KernelKey key;
  FwdLauncher fwd;
  BwdLauncher bwd;
};

#define FLASH_CUDA_KERNEL_fwd(family, dtype, hdim, launcher) \
  TableEntry{{"fwd", family, dtype, hdim}, launcher, nullptr},
#define FLASH_CUDA_KERNEL_bwd(family, dtype, hdim, launcher) \
  TableEntry{{"bwd", family, dtype, hdim}, nullptr, launcher},
#define FLASH_CUDA_KERNEL(direction, family, dtype, hdim, launcher) \
  FLASH_CUDA_KERNEL_##direction(family, dtype, hdim, launcher)

const std::vector<TableEntry>& table() {
  static const std::vector<TableEntry> entries = {
#include "generated/kernel_table.inc"
  };
  return entries;
}

#include "generated/build_info.inc"

// The archs this build compiled for.
std::vector<int> compiled_archs() { return FLASH_CUDA_BUILD_ARCHS; }

const char* dtype_name(DType dtype) { return dtype == DType::kBFloat16 ? "bfloat16" : "float16"; }

KernelChoice find(const char* direction, int sm, DType dtype, int head_dim) {
  KernelChoice choice;
  if (!family_for_arch(sm, &choice.family, &choice.error)) return choice;
  const TableEntry* best = nullptr;
  auto matches = [&](const TableEntry& e) {
    return std::strcmp(e.key.direction, direction) == 0 && e.key.family == choice.family &&
           e.key.dtype == dtype;
  };
  for (const TableEntry& e : table()) {
    if (matches(e) && e.key.head_dim >= head_dim &&
        (best == nullptr || e.key.head_dim < best->key.head_dim)) {
      best = &e;
    }
  }
  if (best == nullptr) {
    std::string available;  // built only for the error message
    for (const TableEntry& e : table()) {
      if (matches(e)) available += (available.empty() ? "" : ", ") + std::to_string(e.key.head_dim);
    }
    choice.error = std::string("flash_cuda was built without a ") + direction +
                   " kernel for head dim " + std::to_string(head_dim) + " in " +
                   dtype_name(dtype) + " (compiled head dims: " +
                   (available.empty() ? "none" : available) +
                   "); rebuild with FLASH_CUDA_HDIMS including a head dim >= " +
                   std::to_string(head_dim) +
                   (std::string(direction) == "bwd" ? " and without FLASH_CUDA_DISABLE_BACKWARD" : "");
    return choice;
  }
  choice.fwd = best->fwd;
  choice.bwd = best->bwd;
  choice.head_dim = best->key.head_dim;
  return choice;
}

}  // namespace

bool family_for_arch(int sm, ArchFamily* family, std::string* error) {
  if (sm < 80) {
    *error = "flash_cuda needs a GPU of compute capability 8.0 or newer (Ampere, Hopper, ...); "
             "this one is " + std::to_string(sm / 10) + "." + std::to_string(sm % 10);
    return false;
  }
  const std::vector<int> archs = compiled_archs();
  // Machine code for sm_X runs on any device of the same major version with minor >= X's;
  // the PTX embedded for the newest arch is compiled by the driver for any newer GPU.
  const bool runs = std::any_of(archs.begin(), archs.end(), [sm](int a) {
    return a / 10 == sm / 10 && a <= sm;
  }) || (!archs.empty() && sm > archs.back());
  if (!runs) {
    std::string list;
    for (int a : archs) list += (list.empty() ? "" : ", ") + std::to_string(a);
    *error = "flash_cuda was not compiled for this GPU (compute capability " +
             std::to_string(sm / 10) + "." + std::to_string(sm % 10) +
             "; compiled archs: " + list + "); rebuild with FLASH_CUDA_ARCHS including " +
             std::to_string(sm);
    return false;
  }
  *family = ArchFamily::kSm80;
  return true;
}

KernelChoice find_fwd(int sm, DType dtype, int head_dim) { return find("fwd", sm, dtype, head_dim); }
KernelChoice find_bwd(int sm, DType dtype, int head_dim) { return find("bwd", sm, dtype, head_dim); }

}  // namespace flash_cuda
