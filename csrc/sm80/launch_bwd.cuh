// Host-side launch of the portable backward for one (dtype, head dim): the main kernel, then the
// conversion of its dQ accumulator to dQ.  The caller has run the preprocess kernel (rowsum(dO *
// O), zeroing the accumulator) on the same stream.
#pragma once

#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/launch_api.h"
#include "sm80/bwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class Kernel> cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream) {
  const dim3 grid(tiles(params.fwd.seq_k.seqlen, Kernel::kBlockN), params.fwd.heads_q,
                  params.fwd.batch);
  cudaError_t err = launch_with_smem(&bwd_kernel<Kernel>, grid, Kernel::kThreads,
                                     Kernel::kSmemBytes, stream, params);
  if (err != cudaSuccess) return err;
  const dim3 convert_grid(tiles(params.fwd.seq_q.seqlen, Kernel::kBlockM), params.fwd.heads_q,
                          params.fwd.batch);
  return launch_with_smem(&bwd_convert_dq_kernel<Kernel>, convert_grid, Kernel::kThreads, 0,
                          stream, params);
}

// Picks the tile table by the code the device runs, not by the device: a build for sm80 only
// runs on an sm90 GPU through its compute_80 PTX, where the sm90 table's body is empty.  The
// PTX version of the sm90 kernel's loaded image is the __CUDA_ARCH__ it was compiled for.
template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Sm90 = BwdKernel<ElementTag, kHeadDim, BwdTileConfigSm90<kHeadDim>>;
  using Sm80 = BwdKernel<ElementTag, kHeadDim, BwdTileConfig<kHeadDim>>;
  cudaFuncAttributes attr;
  const cudaError_t err = cudaFuncGetAttributes(&attr, bwd_kernel<Sm90>);
  if (err != cudaSuccess) return err;
  if (attr.ptxVersion >= Sm90::Config::kMinArch) return launch_bwd<Sm90>(params, stream);
  return launch_bwd<Sm80>(params, stream);
}

}  // namespace flash_cuda::sm80
