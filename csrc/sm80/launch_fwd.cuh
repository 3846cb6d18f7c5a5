// Host-side launch of the portable forward kernel for one (dtype, head dim): its tile table and
// grid shape; the shared-memory opt-in and launch check are common/launch.cuh's.
#pragma once

#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/launch_api.h"
#include "sm80/fwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class Kernel> cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream) {
  const dim3 grid(tiles(params.seq_q.seqlen, Kernel::kBlockM), params.heads_q, params.batch);
  return launch_with_smem(&fwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSmemBytes, stream,
                          params);
}

// The tile table is picked by the code the device runs (runs_code_for).
template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Sm90 = FwdKernel<ElementTag, kHeadDim, FwdTileConfigSm90<kHeadDim>>;
  using Sm80 = FwdKernel<ElementTag, kHeadDim, FwdTileConfig<kHeadDim>>;
  bool sm90 = false;
  const cudaError_t err = runs_code_for(&fwd_kernel<Sm90>, Sm90::Config::kMinArch, &sm90);
  if (err != cudaSuccess) return err;
  return sm90 ? launch_fwd<Sm90>(params, stream) : launch_fwd<Sm80>(params, stream);
}

}  // namespace flash_cuda::sm80
