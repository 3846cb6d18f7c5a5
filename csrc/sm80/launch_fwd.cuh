// Host-side launch of the portable forward kernel for one (dtype, head dim): its grid shape;
// the shared-memory opt-in and launch check are common/launch.cuh's.
#pragma once

#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/launch_api.h"
#include "sm80/fwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Kernel = FwdKernel<ElementTag, kHeadDim, FwdTileConfig<kHeadDim>>;
  const dim3 grid(tiles(params.seq_q.seqlen, Kernel::kBlockM), params.heads_q, params.batch);
  return launch_with_smem(&fwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSmemBytes, stream,
                          params);
}

}  // namespace flash_cuda::sm80
