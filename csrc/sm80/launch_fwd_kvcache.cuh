// Host-side launch of the portable attention over a KV cache (Note [KV-cache forward] in
// sm80/fwd_kernel.cuh) for one (dtype, head dim), and the kernels around it: the append of the
// new keys (common/append_kv.cuh), q's rotation, the split count, the GQA packing of a decode
// step, the partials and their combine (common/combine.cuh).  The workspace holds the rotated
// q, then the partials.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "common/append_kv.cuh"
#include "common/combine.cuh"
#include "common/gqa_pack.h"
#include "common/launch.cuh"
#include "common/launch_api.h"
#include "common/tile_order.cuh"
#include "sm80/fwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class ElementTag, int kHeadDim>
using KvcacheKernel = FwdKernel<ElementTag, kHeadDim, FwdKvcacheTileConfig<kHeadDim>, true>;
template <class ElementTag, int kHeadDim>
using KvcacheKernelSmall = FwdKernel<ElementTag, kHeadDim, FwdTileConfigSmall<kHeadDim>, true>;
template <class ElementTag, int kHeadDim>
using KvcacheKernelDecode = FwdKernel<ElementTag, kHeadDim, FwdDecodeTileConfig<kHeadDim>, true>;
template <class ElementTag, int kHeadDim>
using KvcacheKernelDecodeTma =
    FwdKernel<ElementTag, kHeadDim, FwdDecodeTmaTileConfig<kHeadDim>, true>;

constexpr int kMaxGridZ = 65535;

template <class Kernel> struct KernelTag { using type = Kernel; };

// The cp.async decode kernel a TMA one stands in for (Note [TMA key tiles]): the split count
// and a launch whose tensor maps the driver refuses take it.
template <class Kernel>
using PlainDecodeOf = std::conditional_t<
    Kernel::kTmaKeys, KvcacheKernelDecode<typename Kernel::Tag, Kernel::kHeadDim>, Kernel>;

// The tensor maps of K and V for TMA key tiles of (64 columns, box_rows rows): a dense cache as
// (head_dim, capacity, heads_kv, cache rows), a paged one as (head_dim, page_size, heads_kv,
// pages), 128-byte swizzle, zeros outside.  False where the driver refuses them.
inline bool encode_cache_maps(const FwdParams& p, bool bf16, int box_rows, CUtensorMap* k,
                              CUtensorMap* v) {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      fn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  const KvCacheArgs& kv = p.kv;
  const int64_t rows = kv.page_table != nullptr ? kv.page_size : kv.capacity;
  if (encode == nullptr || p.head_dim <= 0 || rows <= 0 || p.heads_kv <= 0 || kv.cache_dim0 <= 0) {
    return false;
  }
  const cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  auto one = [&](const TensorRef& t, CUtensorMap* map) {
    const cuuint64_t dims[4] = {cuuint64_t(p.head_dim), cuuint64_t(rows), cuuint64_t(p.heads_kv),
                                cuuint64_t(kv.cache_dim0)};
    const cuuint64_t strides[3] = {cuuint64_t(t.row_stride) * 2, cuuint64_t(t.head_stride) * 2,
                                   cuuint64_t(t.batch_stride) * 2};
    return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                  4, t.ptr, dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  return one(p.k, k) && one(p.v, v);
}

// Whether the decode kernel with TMA key tiles (Note [TMA key tiles]) runs this problem: the
// device runs its sm90 code, TMA can address the caches (16-byte aligned bases and strides),
// and a paged cache's pages hold whole key tiles with no leftpad shifting a sequence off them.
// FLASH_CUDA_NO_TMA_DECODE=1 (read at every call) turns it off, for comparisons.  The split
// count does not depend on the answer (kvcache_splits counts the cp.async kernel's blocks for
// both), so get_scheduler_metadata, which has no cache pointers, reports the count the call runs.
template <class Kernel> bool decode_tma_fits(const FwdParams& p) {
  const char* off = std::getenv("FLASH_CUDA_NO_TMA_DECODE");
  if (off != nullptr && off[0] == '1' && off[1] == '\0') return false;
  bool yes = false;
  if (runs_code_for(&fwd_kvcache_tma_kernel<Kernel>, 90, &yes) != cudaSuccess) {
    (void)cudaGetLastError();  // the error this query raised, not an earlier one
    return false;
  }
  if (!yes) return false;
  auto aligned = [](int64_t elements) { return elements % 8 == 0; };  // 16 bytes
  const KvCacheArgs& kv = p.kv;
  if (reinterpret_cast<uintptr_t>(p.k.ptr) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.v.ptr) % 16 != 0) {
    return false;
  }
  for (const TensorRef* t : {&p.k, &p.v}) {
    if (!aligned(t->row_stride) || !aligned(t->head_stride) || !aligned(t->batch_stride)) {
      return false;
    }
  }
  return kv.page_table == nullptr ||
         (kv.page_size % Kernel::kBlockN == 0 && kv.leftpad == nullptr);
}

// Calls f(KernelTag<K>{}) with the kernel that runs this problem: the decode tiles when its
// (packed) query rows per head fit one of their blocks, otherwise the forward's tiles (the
// small ones where the device's blocks cannot hold those).
template <class ElementTag, int kHeadDim, class F>
cudaError_t with_kvcache_kernel(const FwdParams& p, F&& f) {
  using Decode = KvcacheKernelDecode<ElementTag, kHeadDim>;
  using Kernel = KvcacheKernel<ElementTag, kHeadDim>;
  if (packed_view(p).seq_q.seqlen <= Decode::kBlockM) {
    if constexpr (kHeadDim % 64 == 0) {
      using DecodeTma = KvcacheKernelDecodeTma<ElementTag, kHeadDim>;
      if (decode_tma_fits<DecodeTma>(p)) return f(KernelTag<DecodeTma>{});
    }
    return f(KernelTag<Decode>{});
  }
  if constexpr (Kernel::Config::kHasSmallTile) {
    int smem_limit = 0;
    const cudaError_t err = max_smem_per_block(&smem_limit);
    if (err != cudaSuccess) return err;
    if (smem_limit < Kernel::kSmemBytes) {
      return f(KernelTag<KvcacheKernelSmall<ElementTag, kHeadDim>>{});
    }
  }
  return f(KernelTag<Kernel>{});
}

// How many blocks of `Kernel` an SM holds at once (at least 1).
template <class Kernel> int kvcache_blocks_per_sm() {
  int n = 0;
  const auto kernel = [] {
    if constexpr (Kernel::kTmaKeys) {
      return &fwd_kvcache_tma_kernel<Kernel>;
    } else {
      return &fwd_kernel<Kernel>;
    }
  }();
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Kernel::kSmemBytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, Kernel::kThreads,
                                                    Kernel::kSmemBytes) != cudaSuccess) {
    (void)cudaGetLastError();  // a launch that cannot run reports it itself
    return 1;
  }
  return std::max(n, 1);
}

// Splits of the keys: the forced count, or the fewest whose grid fills its waves of resident
// blocks (sms x blocks per SM) nearly as well as any count does, each split keeping at least
// kMinSplitKeys keys and 2 key tiles of the cache's capacity (the lengths themselves are on the
// GPU).  A wave's blocks are equal work here (every sequence of a step is assumed as long as the
// capacity).  Fewer keys per split lost to the combine and the blocks' fixed costs at batch 1
// with an 8k cache (NOTES entry 48).  Where even the most splits leave the grid short of one
// wave and the unsplit grid has fewer than kShortGridBlocksPerSm blocks per SM (a step of few
// sequences), the count aims at that many blocks per SM instead, each split keeping
// kMinShortSplitKeys keys: entries 80 and 82 timed 64 splits of 8 blocks (batch 1) and 17 of 32
// (batch 4) faster than the count above, on 132 SMs.  Grids of fewer than kFewBlocks blocks
// unsplit (one KV head at batch 1: NOTES entry 86) split down to one key tile of
// kMinFewSplitKeys keys, up to the combine's limit; the rest keep kMaxWaveSplits.
constexpr int kMinSplitKeys = 256;
constexpr int kShortGridBlocksPerSm = 4;
constexpr int kMinShortSplitKeys = 128;
constexpr int kFewBlocks = 8;
constexpr int kMinFewSplitKeys = 64;
constexpr int kMaxWaveSplits = 128;
template <class Kernel> int kvcache_splits(const FwdParams& p, int sms) {
  // Grid z is batch x splits (at most kMaxGridZ).
  if (p.batch <= 0 || p.batch > kMaxGridZ) return 1;
  if (p.split.num_splits > 0) {
    return std::max(1, std::min({p.split.num_splits, kCombineMaxSplits, kMaxGridZ / p.batch}));
  }
  const FwdParams v = packed_view(p);
  const int64_t blocks =
      int64_t(tiles(v.seq_q.seqlen, Kernel::kBlockM)) * v.heads_q * std::max(v.batch, 1);
  const int most = std::min({int(tiles(p.kv.capacity, Kernel::kBlockN)) / 2,
                             int(p.kv.capacity / kMinSplitKeys), kMaxWaveSplits,
                             kMaxGridZ / p.batch});
  if (blocks == 0 || most < 2) return 1;
  const double slots = double(sms) * kvcache_blocks_per_sm<PlainDecodeOf<Kernel>>();
  if (double(blocks) * most < slots && blocks < int64_t(kShortGridBlocksPerSm) * sms) {
    const int64_t want = (int64_t(kShortGridBlocksPerSm) * sms + blocks - 1) / blocks;
    const bool few = blocks < kFewBlocks;
    const int cap = std::min({int(tiles(p.kv.capacity, Kernel::kBlockN)) / (few ? 1 : 2),
                              int(p.kv.capacity / (few ? kMinFewSplitKeys : kMinShortSplitKeys)),
                              few ? kCombineMaxSplits : kMaxWaveSplits, kMaxGridZ / p.batch});
    return int(std::max<int64_t>(1, std::min<int64_t>(cap, want)));
  }
  auto efficiency = [&](int s) {
    const double waves = double(blocks) * s / slots;
    return waves / std::ceil(waves);
  };
  double best = 0.;
  for (int s = 1; s <= most; ++s) best = std::max(best, efficiency(s));
  int s = 1;
  while (s < most && efficiency(s) < 0.85 * best) ++s;
  return s;
}

// The partials of num_splits > 1: float32 O (splits, batch, seqlen_q, heads_q, head_dim) and
// lse (splits, batch, seqlen_q, heads_q), dense rows; a varlen q is one batch of total rows.
inline int64_t kvcache_partial_rows(const FwdParams& p) {
  return p.seq_q.cu_seqlens != nullptr ? int64_t(p.seq_q.total_rows)
                                       : int64_t(p.batch) * p.seq_q.seqlen;
}

// The workspace: the rotated q (when rotary), then the partials, each 256-byte aligned.
struct KvcacheWorkspace {
  size_t q_bytes = 0, partial_bytes = 0;
  size_t total() const { return q_bytes + partial_bytes; }
};

template <class ElementTag, int kHeadDim>
KvcacheWorkspace kvcache_workspace(const KvcacheParams& kp, int splits) {
  const FwdParams& p = kp.fwd;
  auto round_up = [](size_t n) { return (n + 255) / 256 * 256; };
  KvcacheWorkspace w;
  const int64_t rows = kvcache_partial_rows(p);
  if (kp.rotary.cos != nullptr) {
    w.q_bytes = round_up(size_t(rows) * p.heads_q * p.head_dim *
                         sizeof(typename KvcacheKernel<ElementTag, kHeadDim>::Element));
  }
  if (splits > 1) {
    w.partial_bytes = round_up(size_t(splits) * rows * p.heads_q * (size_t(p.head_dim) + 1) *
                               sizeof(float));
  }
  return w;
}

template <class ElementTag, int kHeadDim>
size_t fwd_kvcache_workspace_bytes(const KvcacheParams& kp) {
  int sms = 0;
  if (sm_count(&sms) != cudaSuccess) return 0;  // the launch reports the broken device
  size_t bytes = 0;
  (void)with_kvcache_kernel<ElementTag, kHeadDim>(kp.fwd, [&](auto tag) {
    using Kernel = typename decltype(tag)::type;
    bytes = kvcache_workspace<ElementTag, kHeadDim>(kp, kvcache_splits<Kernel>(kp.fwd, sms))
                .total();
    return cudaSuccess;
  });
  return bytes;
}

template <class ElementTag, int kHeadDim> bool fwd_kvcache_supports(const KvcacheParams&) {
  return true;
}

// The split count run_fwd_kvcache uses for this problem (get_scheduler_metadata reports it); 0
// when the device cannot be queried.
template <class ElementTag, int kHeadDim> int fwd_kvcache_num_splits(const KvcacheParams& kp) {
  int sms = 0;
  if (sm_count(&sms) != cudaSuccess) return 0;
  int splits = 0;
  (void)with_kvcache_kernel<ElementTag, kHeadDim>(kp.fwd, [&](auto tag) {
    splits = kvcache_splits<typename decltype(tag)::type>(kp.fwd, sms);
    return cudaSuccess;
  });
  return splits;
}

// Note [Overlapped launches]
// A decode step is two or three short kernels (append and rotate, attention, combine) of a few
// microseconds each, and the gap between two dependent kernels is a real part of it.  The
// attention kernel and the combine are launched with programmatic dependent launch
// (launch_overlapped): the next kernel's blocks may be scheduled once every block of the one
// before has called pdl_release (the append kernels and the attention kernel call it first
// thing), and they then wait in pdl_wait, at their top, until that kernel has completed and its
// writes are visible.  So the combine's launch and its blocks' setup hide under the attention
// kernel's last blocks, and the attention's under the append.  Only the decode path launches this
// way; on GPUs older than sm90 (or on sm80 PTX) the launches are plain ones.
template <class Kernel>
cudaError_t launch_kvcache(const FwdParams& params, void* workspace, int splits,
                           cudaStream_t stream) {
  FwdParams p = params;
  p.split.num_splits = splits;
  if (splits > 1) {
    // Partials as (split, row, head, dim) over the problem's own rows and heads, then the
    // packed view's strides over them (a packed row is a head of the group).
    const int64_t rows = kvcache_partial_rows(params);
    const int64_t seqlen = params.seq_q.cu_seqlens != nullptr ? rows : params.seq_q.seqlen;
    SplitArgs& s = p.split;
    s.o = static_cast<float*>(workspace);
    s.o_head_stride = params.head_dim;
    s.o_row_stride = int64_t(params.heads_q) * params.head_dim;
    s.o_batch_stride = params.seq_q.cu_seqlens != nullptr ? 0 : seqlen * s.o_row_stride;
    s.o_split_stride = rows * s.o_row_stride;
    s.lse = s.o + splits * s.o_split_stride;
    s.lse_head_stride = 1;
    s.lse_row_stride = params.heads_q;
    s.lse_batch_stride = params.seq_q.cu_seqlens != nullptr ? 0 : seqlen * s.lse_row_stride;
    s.lse_split_stride = rows * s.lse_row_stride;
  }
  FwdParams v = packed_view(p);
  if (packs_gqa(p) && splits > 1) {
    const int group = p.heads_q / p.heads_kv;
    v.split.o_row_stride = p.split.o_head_stride;
    v.split.o_head_stride = p.split.o_head_stride * group;
    v.split.lse_row_stride = p.split.lse_head_stride;
    v.split.lse_head_stride = p.split.lse_head_stride * group;
  }
  v.block_shift = 0;
  const dim3 grid(tiles(v.seq_q.seqlen, Kernel::kBlockM), v.heads_q, v.batch * splits);
  // Both kernels start while the one before them finishes (Note [Overlapped launches]).
  cudaError_t err;
  if constexpr (Kernel::kTmaKeys) {
    DecodeTmaParams tp;
    tp.fwd = v;
    if (!encode_cache_maps(v, std::is_same_v<typename Kernel::Element, __nv_bfloat16>,
                           Kernel::kBlockN, &tp.k, &tp.v)) {
      // Maps the driver refuses: the cp.async kernel, with the same split count.
      return launch_kvcache<PlainDecodeOf<Kernel>>(params, workspace, splits, stream);
    }
    err = launch_with_smem(&fwd_kvcache_tma_kernel<Kernel>, grid, Kernel::kThreads,
                           Kernel::kSmemBytes, stream, tp, /*overlap=*/true);
  } else {
    err = launch_with_smem(&fwd_kernel<Kernel>, grid, Kernel::kThreads, Kernel::kSmemBytes,
                           stream, v, /*overlap=*/true);
  }
  if (err != cudaSuccess || splits <= 1) return err;
  CombineArgs c;
  c.split = p.split;
  c.o = p.o;
  c.lse = p.lse;
  c.seq_q = p.seq_q;
  c.heads = p.heads_q;
  c.head_dim = p.head_dim;
  const int64_t items = int64_t(p.seq_q.seqlen) * c.heads;
  const dim3 blocks = combine_grid(items, p.batch);
  using Element = typename Kernel::Element;
  return launch_overlapped(&combine_kernel<Element>, blocks, kCombineWarps * 32, 0, stream, c);
}

template <class ElementTag, int kHeadDim>
cudaError_t run_fwd_kvcache(const KvcacheParams& kp, void* workspace, cudaStream_t stream) {
  using Element = typename KvcacheKernel<ElementTag, kHeadDim>::Element;
  const FwdParams& params = kp.fwd;
  int sms = 0;
  cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  // Refused before anything is written: the grids' y and z limits.
  if (params.batch > kMaxGridZ || params.heads_q > kMaxGridZ) return cudaErrorInvalidConfiguration;
  // The decode tiles address a page's K and V rows by one offset (ops/kvcache_cuda.cpp takes
  // caches of the same strides only).
  if (params.k.batch_stride != params.v.batch_stride ||
      params.k.row_stride != params.v.row_stride) {
    return cudaErrorInvalidValue;
  }
  return with_kvcache_kernel<ElementTag, kHeadDim>(params, [&](auto tag) {
    using Kernel = typename decltype(tag)::type;
    const int splits = kvcache_splits<Kernel>(params, sms);
    if (splits > 1 && int64_t(params.seq_q.seqlen) * params.heads_q > kCombineMaxRows) {
      return cudaErrorInvalidConfiguration;
    }
    const KvcacheWorkspace w = kvcache_workspace<ElementTag, kHeadDim>(kp, splits);
    char* base = static_cast<char*>(workspace);
    Element* q_rot = w.q_bytes > 0 ? reinterpret_cast<Element*>(base) : nullptr;
    cudaError_t e = append_and_rotate<Element>(kp, q_rot, stream);
    if (e != cudaSuccess) return e;
    if (params.batch == 0 || params.heads_q == 0 || kvcache_partial_rows(params) == 0) {
      return cudaSuccess;
    }
    FwdParams p = params;
    if (q_rot != nullptr) p.q = rotated_q_ref(p, q_rot);  // attention reads the rotated q
    return launch_kvcache<Kernel>(p, base + w.q_bytes, splits, stream);
  });
}

}  // namespace flash_cuda::sm80
