// Host-side launch of the Hopper forward kernel for one (dtype, head dim): the TMA descriptors of
// Q, K and V, the grid (in the block order of common/tile_order.cuh) and the problems it takes.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/launch.cuh"
#include "common/gqa_pack.h"
#include "common/launch_api.h"
#include "common/tile_order.cuh"
#include "sm90/fwd_kernel.cuh"

namespace flash_cuda::sm90 {

template <class ElementTag, int kHeadDim>
using FwdKernelFor = FwdKernel<ElementTag, kHeadDim, FwdTileConfig<kHeadDim>>;

// Whether TMA can address a tensor: a 16-byte aligned base (null for an empty tensor) and
// strides that are multiples of 16 bytes below 2^40 bytes.  The op layer copies tensors whose
// rows are not 16-byte aligned, so this holds for what it hands over; what is left to decline
// is the block's shared memory, which FLASH_CUDA_SMEM_LIMIT_KB can lower below the tile's.
template <class Element> bool tma_addressable(const TensorRef& t) {
  auto ok = [](int64_t stride) {
    const int64_t bytes = stride * int64_t(sizeof(Element));
    return bytes % 16 == 0 && bytes >= 0 && bytes < (int64_t(1) << 40);
  };
  return reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && ok(t.row_stride) && ok(t.head_stride) &&
         ok(t.batch_stride);
}

// The launch steps for a kernel type: fwd_supports_for, fwd_workspace_bytes_for and
// run_fwd_for serve FwdKernelFor (run_fwd and its kin, below) and the KV-cache units' kernel
// that reads the cache in place (sm90/launch_fwd_kvcache.cuh).
template <class Kernel> bool fwd_supports_for(const FwdParams& p) {
  using Element = typename Kernel::Element;
  if (!tma_addressable<Element>(p.q) || !tma_addressable<Element>(p.k) ||
      !tma_addressable<Element>(p.v)) {
    return false;
  }
  int limit = 0;
  if (max_smem_per_block(&limit) != cudaSuccess) {
    cudaGetLastError();  // the portable family's launch reports a broken device
    return false;
  }
  return Kernel::kSmemBytes <= limit;
}

// The tile counter of the persistent kernel's dynamic schedule.
template <class Kernel> size_t fwd_workspace_bytes_for(const FwdParams&) {
  return Kernel::kPersistent ? sizeof(int) : 0;
}

template <class Kernel>
cudaError_t run_fwd_for(const FwdParams& problem, void* workspace, cudaStream_t stream) {
  // A GQA decode step reads its keys once per group (common/gqa_pack.h).
  const FwdParams p = packed_view(problem);
  using Element = typename Kernel::Element;
  const unsigned m_tiles = tiles(p.seq_q.seqlen, Kernel::kBlockM);
  // No query rows (then out and lse are empty too): nothing to write.
  if (m_tiles == 0 || p.batch == 0 || p.heads_q == 0 || p.q.ptr == nullptr) return cudaSuccess;
  // The op layer checks it; a bad call must not divide by zero here (div_group below).
  if (p.heads_kv <= 0 || p.heads_q % p.heads_kv != 0) return cudaErrorInvalidValue;

  // A packed tensor is one batch of total_rows rows.  An empty K / V (null, no rows) gets a
  // one-row descriptor on Q's memory, which no load uses (no key tile is visible), since a TMA
  // descriptor can be neither empty nor null.
  auto gmem = [&](const TensorRef& t, const SeqArgs& seq, int heads) {
    const bool varlen = seq.cu_seqlens != nullptr;
    const int rows = std::max(varlen ? seq.total_rows : seq.seqlen, 1);
    const void* base = t.ptr != nullptr ? t.ptr : p.q.ptr;
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(base)),
                       make_shape(rows, p.head_dim, heads, varlen ? 1 : p.batch),
                       make_stride(t.row_stride, _1{}, t.head_stride, t.batch_stride));
  };
  auto mQ = gmem(p.q, p.seq_q, p.heads_q);
  // O leaves by TMA where its rows are the tensor's (not packed sequences, whose tile would
  // run into the next sequence) and TMA can address it; otherwise the descriptor sits, unused,
  // on Q's memory.
  const bool tma_store_o = Kernel::kOSlabs && p.seq_q.cu_seqlens == nullptr &&
                           tma_addressable<Element>(p.o);
  auto mO = make_tensor(make_gmem_ptr(static_cast<Element*>(tma_store_o ? p.o.ptr : p.q.ptr)),
                        mQ.shape(),
                        tma_store_o ? make_stride(p.o.row_stride, _1{}, p.o.head_stride,
                                                  p.o.batch_stride)
                                    : mQ.stride());
  // A KV cache read in place (Note [Keys in place] in sm90/launch_fwd_kvcache.cuh): K and V are
  // the cache, whose dimension 0 is a cache row (cache_batch_idx picks one per sequence) or a
  // page of page_size rows.
  auto cache = [&](const TensorRef& t) {
    const int rows = p.kv.page_table != nullptr ? p.kv.page_size : std::max(p.seq_k.seqlen, 1);
    // (A cache of no rows may have a null pointer: the descriptor then sits, unused, on Q's.)
    const void* base = t.ptr != nullptr ? t.ptr : p.q.ptr;
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(base)),
                       make_shape(rows, p.head_dim, p.heads_kv, p.kv.cache_dim0),
                       make_stride(t.row_stride, _1{}, t.head_stride, t.batch_stride));
  };
  bool in_cache = false;
  if constexpr (Kernel::kCacheKeys) {
    in_cache = p.kv.page_table != nullptr || p.kv.batch_idx != nullptr;
  }
  auto mK = in_cache ? cache(p.k) : gmem(p.k, p.seq_k, p.heads_kv);
  auto mV = in_cache ? cache(p.v) : gmem(p.v, p.seq_k, p.heads_kv);
  typename Kernel::Params params{
      make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Kernel::SmemLayoutQ{},
                    select<0, 2>(typename Kernel::TileShapeQK{}), _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Kernel::SmemLayoutKV{}),
                    select<1, 2>(typename Kernel::TileShapeQK{}), _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, mV, take<0, 2>(typename Kernel::SmemLayoutKV{}),
                    select<1, 2>(typename Kernel::TileShapeQK{}), _1{}),
      make_tma_copy(SM90_TMA_STORE{}, mO, typename Kernel::SmemLayoutOSlab{},
                    Shape<_64, Int<Kernel::kHeadDim>>{}, _1{}),
      tma_store_o,
      mQ.shape(),
      mK.shape(),
      p,
      /*tiles_x=*/0,
      /*tiles_y=*/0,
      /*total_tiles=*/0,
      /*tile_counter=*/static_cast<int*>(workspace),
      /*div_x, div_y, div_group: below*/ {}, {}, {}};

  // The tiles of a (batch, head) read its K and V (Note [Block order]).  Blocks take them in
  // that order: one per tile, or (kPersistent) one per SM, each taking its next tile from the
  // counter in the workspace (zeroed here, on the stream).  Persistent on dense queries, a
  // group takes up to 32 heads, as many as L2's budget holds: under a causal mask the heaviest
  // tiles of many heads then go first, and the end is left to light ones (benchmarks/NOTES.md
  // entry 64: +3% at seqlen 1k-4k, +7-8% at head dim 256 causal 2k-4k).  Packed sequences keep
  // groups of 2 heads (a mixed batch timed alone ran within 1% either way), and so does one
  // block per tile (the hardware hands out the blocks; bigger groups lost there on the portable
  // family).
  const bool wide_groups = Kernel::kPersistent && p.seq_q.cu_seqlens == nullptr;
  const BlockOrder order(m_tiles, p.heads_q, p.batch, p.masked(),
                         2 * int64_t(p.seq_k.seqlen) * p.head_dim * int64_t(sizeof(Element)),
                         /*max_shift=*/wide_groups ? 5 : 1);
  params.problem.block_shift = order.shift;
  const int64_t total = int64_t(order.grid.x) * order.grid.y * order.grid.z;
  if (total >= (int64_t(1) << 31)) return cudaErrorInvalidConfiguration;
  params.tiles_x = int(order.grid.x);
  params.tiles_y = int(order.grid.y);
  params.total_tiles = int(total);
  params.div_x = cutlass::FastDivmod(params.tiles_x);
  params.div_y = cutlass::FastDivmod(params.tiles_y);
  params.div_group = cutlass::FastDivmod(p.heads_q / p.heads_kv);
  dim3 grid = order.grid;
  if constexpr (Kernel::kPersistent) {
    int sms = 0;
    cudaError_t err = sm_count(&sms);
    if (err != cudaSuccess) return err;
    // The producers draw tile indices up to total + sms - 1 (each block once past the last
    // tile): all of them must fit an int.
    if (total + sms >= (int64_t(1) << 31)) return cudaErrorInvalidConfiguration;
    err = cudaMemsetAsync(workspace, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
    grid = dim3(unsigned(std::min<int64_t>(total, sms)));
  }
  return launch_with_smem(&fwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSmemBytes, stream,
                          params);
}

template <class ElementTag, int kHeadDim> bool fwd_supports(const FwdParams& p) {
  return fwd_supports_for<FwdKernelFor<ElementTag, kHeadDim>>(p);
}

template <class ElementTag, int kHeadDim> size_t fwd_workspace_bytes(const FwdParams& p) {
  return fwd_workspace_bytes_for<FwdKernelFor<ElementTag, kHeadDim>>(p);
}

template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& problem, void* workspace, cudaStream_t stream) {
  return run_fwd_for<FwdKernelFor<ElementTag, kHeadDim>>(problem, workspace, stream);
}

}  // namespace flash_cuda::sm90
