// Declarations of every kernel family's launchers.  The generated translation units instantiate
// them and the dispatcher takes their addresses; this header is plain C++ (no device code).
#pragma once

#include <cuda_runtime_api.h>

#include "common/params.h"

namespace flash_cuda {

// Element tags: the dispatcher names dtypes without seeing CUDA's half types.
struct half_t;
struct bfloat16_t;

namespace sm80 {
template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream);
template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream);
// rowsum(dO * O) for every row, written to params.dot_do_o, and the dQ accumulator zeroed;
// dtype chosen at run time.
cudaError_t run_bwd_preprocess(const BwdParams& params, DType dtype, cudaStream_t stream);
}  // namespace sm80

}  // namespace flash_cuda
