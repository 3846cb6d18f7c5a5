// Host-side launch of the portable backward for one (dtype, head dim): the main kernel, then the
// conversion of its dQ accumulator to dQ.  The caller has run the preprocess kernel (rowsum(dO *
// O), zeroing the accumulator) on the same stream.
#pragma once

#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/launch_api.h"
#include "common/tile_order.cuh"
#include "sm80/bwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class Kernel> cudaError_t launch_bwd(const BwdParams& params, cudaStream_t stream) {
  // The blocks of a (batch, head) read its Q and dO and add to its dQ accumulator.
  const FwdParams& f = params.fwd;
  const BlockOrder order(
      tiles(f.seq_k.seqlen, Kernel::kBlockN), f.heads_q, f.batch, f.masked(),
      int64_t(f.seq_q.seqlen) * f.head_dim * (2 * int64_t(sizeof(typename Kernel::Element)) + 4),
      /*max_shift=*/3);
  BwdParams p = params;
  p.fwd.block_shift = order.shift;
  cudaError_t err = launch_with_smem(&bwd_kernel<Kernel>, order.grid, Kernel::kThreads,
                                     Kernel::kSmemBytes, stream, p);
  if (err != cudaSuccess) return err;
  const dim3 convert_grid(tiles(params.fwd.seq_q.seqlen, Kernel::kBlockM), params.fwd.heads_q,
                          params.fwd.batch);
  return launch_with_smem(&bwd_convert_dq_kernel<Kernel>, convert_grid, Kernel::kThreads, 0, stream,
                          params);
}

template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Sm90 = BwdKernel<ElementTag, kHeadDim, BwdTileConfigSm90<kHeadDim>>;
  using Sm80 = BwdKernel<ElementTag, kHeadDim, BwdTileConfig<kHeadDim>>;
  bool sm90 = false;
  const cudaError_t err = runs_code_for(&bwd_kernel<Sm90>, Sm90::Config::kMinArch, &sm90);
  if (err != cudaSuccess) return err;
  return sm90 ? launch_bwd<Sm90>(params, stream) : launch_bwd<Sm80>(params, stream);
}

}  // namespace flash_cuda::sm80
