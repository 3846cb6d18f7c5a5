// Host-side launch of the portable forward kernel for one (dtype, head dim): its grid shape;
// the shared-memory opt-in and launch check are common/launch.cuh's.
#pragma once

#include <cuda_runtime.h>

#include "common/launch.cuh"
#include "common/gqa_pack.h"
#include "common/launch_api.h"
#include "common/tile_order.cuh"
#include "sm80/fwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class Kernel> cudaError_t launch_fwd(const FwdParams& params, cudaStream_t stream) {
  // The blocks of a (batch, head) read its K and V; at most 2 heads per group (Note [Block
  // order]).
  const BlockOrder order(tiles(params.seq_q.seqlen, Kernel::kBlockM), params.heads_q, params.batch,
                         params.masked(),
                         2 * int64_t(params.seq_k.seqlen) * params.head_dim *
                             int64_t(sizeof(typename Kernel::Element)),
                         /*max_shift=*/1);
  FwdParams p = params;
  p.block_shift = order.shift;
  return launch_with_smem(&fwd_kernel<Kernel>, order.grid, Kernel::kThreads, Kernel::kSmemBytes,
                          stream, p);
}

// The portable family takes every problem the op layer accepts.
template <class ElementTag, int kHeadDim> bool fwd_supports(const FwdParams&) { return true; }
template <class ElementTag, int kHeadDim> size_t fwd_workspace_bytes(const FwdParams&) {
  return 0;
}

template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& problem, void* /*workspace: none*/, cudaStream_t stream) {
  // A GQA decode step reads its keys once per group (common/gqa_pack.h).
  const FwdParams params = packed_view(problem);
  using Kernel = FwdKernel<ElementTag, kHeadDim, FwdTileConfig<kHeadDim>>;
  if constexpr (Kernel::Config::kHasSmallTile) {
    // GPUs whose blocks cannot hold this head dim's tiles run the 99 KB ones.
    using Small = FwdKernel<ElementTag, kHeadDim, FwdTileConfigSmall<kHeadDim>>;
    static_assert(Small::kSmemBytes <= kMaxSmemBytesSm86, "the small tiles fit every GPU");
    int smem_limit = 0;
    const cudaError_t err = max_smem_per_block(&smem_limit);
    if (err != cudaSuccess) return err;
    if (smem_limit < Kernel::kSmemBytes) return launch_fwd<Small>(params, stream);
  }
  return launch_fwd<Kernel>(params, stream);
}

}  // namespace flash_cuda::sm80
