// Host-side launch of the portable backward for one (dtype, head dim): the layout of its
// workspace (the float32 dQ accumulator and rowsum(dO * O)), then the preprocess kernel (that
// rowsum, zeroing the accumulator), the main kernel and the conversion of the accumulator to dQ,
// in that order on the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

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

// Where the workspace's two buffers live, in floats from its start: the dQ accumulator (rows of
// kHeadDim, whole tiles per sequence: kDqAccumRowAlign in tile_config.h), then rowsum(dO * O) in
// lse's shape, dense (batch, heads, seqlen_q) or varlen (heads, total_q), 256-byte aligned.
struct BwdWorkspace {
  int64_t acc_rows = 0;      // accumulator rows per (batch, head) dense, per head varlen
  int64_t acc_floats = 0;    // the accumulator's size
  int64_t dot_offset = 0;    // where rowsum(dO * O) starts
  int64_t total_floats = 0;  // the whole workspace

  BwdWorkspace(const BwdParams& p, int head_dim) {
    const FwdParams& f = p.fwd;
    const bool varlen = f.seq_q.cu_seqlens != nullptr;
    const int64_t align = kDqAccumRowAlign;
    acc_rows = varlen ? f.seq_q.total_rows + int64_t(f.batch) * align
                      : (int64_t(f.seq_q.seqlen) + align - 1) / align * align;
    acc_floats = (varlen ? 1 : f.batch) * int64_t(f.heads_q) * acc_rows * head_dim;
    dot_offset = (acc_floats + 63) / 64 * 64;
    const int64_t rows_q = varlen ? f.seq_q.total_rows : int64_t(f.batch) * f.seq_q.seqlen;
    total_floats = dot_offset + int64_t(f.heads_q) * rows_q;
  }
};

template <class ElementTag, int kHeadDim> size_t bwd_workspace_bytes(const BwdParams& params) {
  return size_t(BwdWorkspace(params, kHeadDim).total_floats) * sizeof(float);
}

template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, void* workspace, cudaStream_t stream) {
  using Sm90 = BwdKernel<ElementTag, kHeadDim, BwdTileConfigSm90<kHeadDim>>;
  using Sm80 = BwdKernel<ElementTag, kHeadDim, BwdTileConfig<kHeadDim>>;
  const FwdParams& f = params.fwd;
  const bool varlen = f.seq_q.cu_seqlens != nullptr;
  const BwdWorkspace layout(params, kHeadDim);
  BwdParams p = params;
  float* floats = static_cast<float*>(workspace);
  p.dq_accum.ptr = floats;
  p.dq_accum.batch_stride = varlen ? 0 : int64_t(f.heads_q) * layout.acc_rows * kHeadDim;
  p.dq_accum.head_stride = layout.acc_rows * kHeadDim;
  p.dq_accum.row_stride = kHeadDim;
  p.dq_accum_floats = layout.acc_floats;
  p.dot_do_o.ptr = floats + layout.dot_offset;
  p.dot_do_o.batch_stride = varlen ? 0 : int64_t(f.heads_q) * f.seq_q.seqlen;
  p.dot_do_o.head_stride = varlen ? f.seq_q.total_rows : f.seq_q.seqlen;
  const DType dtype = std::is_same_v<ElementTag, bfloat16_t> ? DType::kBFloat16 : DType::kFloat16;
  cudaError_t err = run_bwd_preprocess(p, dtype, stream);
  if (err != cudaSuccess) return err;
  bool sm90 = false;
  err = runs_code_for(&bwd_kernel<Sm90>, Sm90::Config::kMinArch, &sm90);
  if (err != cudaSuccess) return err;
  return sm90 ? launch_bwd<Sm90>(p, stream) : launch_bwd<Sm80>(p, stream);
}

}  // namespace flash_cuda::sm80
