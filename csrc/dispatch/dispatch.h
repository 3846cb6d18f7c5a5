// Runtime values -> kernel: picks, per op, the compiled launcher for (kernel family, dtype, head
// dim) from the generated tables, falling back to the portable family for a problem a native
// family does not take.  Plain C++: the op layer above it is the only code that sees
// tensors, and it never names a family.
#pragma once

#include <cstddef>
#include <string>

#include "common/launch_api.h"
#include "common/params.h"

namespace flash_cuda {

enum class Op : int { kFwd = 0, kBwd = 1, kFwdKvcache = 2 };

// One op's entry points in a family: what the launcher runs, and what it needs the caller to
// allocate.
struct FwdLauncher {
  bool (*supports)(const FwdParams&) = nullptr;  // the whole problem, pointers included
  size_t (*workspace_bytes)(const FwdParams&) = nullptr;
  cudaError_t (*run)(const FwdParams&, void* workspace, cudaStream_t) = nullptr;
};
struct KvcacheLauncher {
  bool (*supports)(const KvcacheParams&) = nullptr;
  size_t (*workspace_bytes)(const KvcacheParams&) = nullptr;
  cudaError_t (*run)(const KvcacheParams&, void* workspace, cudaStream_t) = nullptr;
  int (*num_splits)(const KvcacheParams&) = nullptr;  // what run will use
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

// The kernel that runs op on a device of compute capability `sm` (e.g. 90): in the first
// compiled family, in the manifest's preference order, that serves `sm` and holds a kernel for
// the op whose head dim (the smallest compiled one >= params' head_dim) supports the problem.
// FLASH_CUDA_FAMILY (read at every call) names the family to try first; the portable family
// stays the fallback.
KernelChoice<FwdLauncher> find_fwd(int sm, DType dtype, const FwdParams& params);
KernelChoice<BwdLauncher> find_bwd(int sm, DType dtype, const BwdParams& params);
KernelChoice<KvcacheLauncher> find_fwd_kvcache(int sm, DType dtype, const KvcacheParams& params);

}  // namespace flash_cuda
