// Runtime values -> kernel: picks the compiled launcher for (arch family, dtype, head dim) from
// the generated table.  Plain C++: the op layer above it is the only code that sees tensors.
#pragma once

#include <string>
#include <vector>

#include "common/launch_api.h"
#include "common/params.h"

namespace flash_cuda {

using FwdLauncher = cudaError_t (*)(const FwdParams&, cudaStream_t);
using BwdLauncher = cudaError_t (*)(const BwdParams&, cudaStream_t);

struct KernelChoice {
  FwdLauncher fwd = nullptr;
  BwdLauncher bwd = nullptr;
  ArchFamily family = ArchFamily::kSm80;
  int head_dim = 0;   // the compiled head dim that serves the request
  std::string error;  // why there is none, in words for the user; empty when found
};

// The family that runs on a device of compute capability `sm` (e.g. 90), or an error.
bool family_for_arch(int sm, ArchFamily* family, std::string* error);

// The smallest compiled head dim >= head_dim for this direction/family/dtype.
KernelChoice find_fwd(int sm, DType dtype, int head_dim);
KernelChoice find_bwd(int sm, DType dtype, int head_dim);

}  // namespace flash_cuda
