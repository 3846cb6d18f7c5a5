// Host-side launch of the portable backward kernel for one (dtype, head dim).  The caller has
// zeroed dq_accum and run the preprocess kernel (rowsum(dO * O)) on the same stream.
#pragma once

#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/launch_api.h"
#include "sm80/bwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Kernel = BwdKernel<ElementTag, kHeadDim>;
  const dim3 grid(tiles(params.fwd.seq_k.seqlen, Kernel::kBlockN), params.fwd.heads_q,
                  params.fwd.batch);
  return launch_with_smem(&bwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSmemBytes,
                          stream, params);
}

}  // namespace flash_cuda::sm80
