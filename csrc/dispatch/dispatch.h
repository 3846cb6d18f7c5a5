// Runtime values -> kernel: picks, per op, the compiled launcher for (kernel family, dtype, head
// dim) from the generated tables.  Plain C++: the op layer above it is the only code that sees
// tensors, and it never names a family.
#pragma once

#include <cstddef>
#include <string>

#include "common/launch_api.h"
#include "common/params.h"

namespace flash_cuda {

enum class Op : int { kFwd = 0, kBwd = 1 };

// One op's entry points in a family: what the launcher runs, and what it needs the caller to
// allocate.
struct FwdLauncher {
  cudaError_t (*run)(const FwdParams&, cudaStream_t) = nullptr;
};
struct BwdLauncher {
  size_t (*workspace_bytes)(const BwdParams&) = nullptr;
  cudaError_t (*run)(const BwdParams&, void* workspace, cudaStream_t) = nullptr;
};

template <class Launcher> struct KernelChoice {
  Launcher launcher;
  const char* family = nullptr;  // the manifest's name, e.g. "sm80"
  int head_dim = 0;              // the compiled head dim that serves the request
  std::string error;             // why there is none, in words for the user; empty when found
  bool found() const { return launcher.run != nullptr; }
};

// The family that runs op on a device of compute capability `sm` (e.g. 90): the first compiled
// family in the manifest's preference order that serves `sm`, or the one FLASH_CUDA_FAMILY
// (read at every call) names; the smallest compiled head dim >= head_dim in it.
KernelChoice<FwdLauncher> find_fwd(int sm, DType dtype, int head_dim);
KernelChoice<BwdLauncher> find_bwd(int sm, DType dtype, int head_dim);

}  // namespace flash_cuda
