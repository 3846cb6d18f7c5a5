// Host-side launch of the portable backward kernel for one (dtype, head dim).  The caller has
// zeroed dq_accum and run the preprocess kernel (rowsum(dO * O)) on the same stream.
#pragma once

#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/launch_api.h"
#include "sm80/bwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class Kernel> cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream) {
  const dim3 grid(tiles(params.fwd.seq_k.seqlen, Kernel::kBlockN), params.fwd.heads_q,
                  params.fwd.batch);
  return launch_with_smem(&bwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSmemBytes, stream,
                          params);
}

// Picks the tile table by the device's compute capability (see BwdTileConfigSm90); the choice
// must match the arch range each config's kernel body is compiled for.
template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  int major = 0;
  const cudaError_t err = current_device_major(major);
  if (err != cudaSuccess) return err;
  using Sm90 = BwdTileConfigSm90<kHeadDim>;
  using Sm80 = BwdTileConfig<kHeadDim>;
  if (major * 10 >= Sm90::kMinArch)
    return launch_bwd<BwdKernel<ElementTag, kHeadDim, Sm90>>(params, stream);
  return launch_bwd<BwdKernel<ElementTag, kHeadDim, Sm80>>(params, stream);
}

}  // namespace flash_cuda::sm80
