// The KV-cache append, for every family: new keys and values written into a dense or paged cache
// at each sequence's cache_seqlens, after rotary embedding, and q rotated into a buffer of its
// own (flash_cuda/reference_kvcache.py states the rules).  One warp per (row, head), a lane per
// 8 head dims; positions and cache rows come from the GPU and are clamped, never trusted.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/seqlen_info.cuh"

namespace flash_cuda {

struct AppendArgs {
  TensorRef k_new, v_new;  // dense (batch, new_rows, heads_kv, d) or packed (cu_seqlens_new)
  TensorRef k_cache, v_cache;  // batch_stride: the stride of the cache's dimension 0
  KvCacheArgs kv;
  RotaryArgs rotary;
  int heads_kv = 0;
  int head_dim = 0;
  int batch = 0;
  int k_new_total_rows = 0;  // packed: k_new's rows
};

struct RotateQArgs {
  TensorRef q, q_out;
  SeqArgs seq_q;
  KvCacheArgs kv;  // cache_seqlens: the default first position
  RotaryArgs rotary;
  int heads = 0;
  int head_dim = 0;
};

constexpr int kAppendWarps = 4;

// Entry i of a cos or sin row, as float (the table holds float32 or Element).
template <class Element>
__device__ __forceinline__ float angle_entry(const RotaryArgs& r, const void* row, int i) {
  return r.float_table ? static_cast<const float*>(row)[i]
                       : static_cast<float>(static_cast<const Element*>(row)[i]);
}

// Rotates (or copies, past the rotary dims) the 8 elements at `col` of one row into `dst`:
// `src` / `dst` point at the row's first element.
template <class Element>
__device__ __forceinline__ void rotate_chunk(const Element* src, Element* dst, int col,
                                             const RotaryArgs& r, int position) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src + col);
  if (r.cos == nullptr || col >= r.rotary_dim) {
    *reinterpret_cast<uint4*>(dst + col) = raw;
    return;
  }
  const int half = r.rotary_dim / 2;
  const int pos = min(max(position, 0), r.rows - 1);
  const int64_t offset = int64_t(pos) * r.row_stride * (r.float_table ? sizeof(float) : sizeof(Element));
  const void* cos_row = static_cast<const char*>(r.cos) + offset;
  const void* sin_row = static_cast<const char*>(r.sin) + offset;
  auto cos_at = [&](int i) { return angle_entry<Element>(r, cos_row, i); };
  auto sin_at = [&](int i) { return angle_entry<Element>(r, sin_row, i); };
  const uint32_t* in = reinterpret_cast<const uint32_t*>(&raw);
  if (r.interleaved) {
    uint4 out;
    uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // pair (col + 2e, col + 2e + 1) uses frequency (col / 2 + e)
      const float2 x = unpack2<Element>(in[e]);
      const float c = cos_at(col / 2 + e), s = sin_at(col / 2 + e);
      o[e] = pack2<Element>(x.x * c - x.y * s, x.x * s + x.y * c);
    }
    *reinterpret_cast<uint4*>(dst + col) = out;
    return;
  }
  // Half-split: element j pairs with j + half.  The lane of the first half's chunk rotates both
  // chunks; the second half's lane has nothing left to do.
  if (col >= half) return;
  const uint4 raw2 = *reinterpret_cast<const uint4*>(src + col + half);
  const uint32_t* in2 = reinterpret_cast<const uint32_t*>(&raw2);
  uint4 out, out2;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
  uint32_t* o2 = reinterpret_cast<uint32_t*>(&out2);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float2 a = unpack2<Element>(in[e]), b = unpack2<Element>(in2[e]);
    const float c0 = cos_at(col + 2 * e), s0 = sin_at(col + 2 * e);
    const float c1 = cos_at(col + 2 * e + 1), s1 = sin_at(col + 2 * e + 1);
    o[e] = pack2<Element>(a.x * c0 - b.x * s0, a.y * c1 - b.y * s1);
    o2[e] = pack2<Element>(a.x * s0 + b.x * c0, a.y * s1 + b.y * c1);
  }
  *reinterpret_cast<uint4*>(dst + col) = out;
  *reinterpret_cast<uint4*>(dst + col + half) = out2;
}

// Element offset, in a paged cache of `cache`'s strides, of row `row` of sequence b: offset
// row % page_size in the page its table names for it (clamped to the cache's pages).
__device__ __forceinline__ int64_t paged_row_offset(const KvCacheArgs& kv, const TensorRef& cache,
                                                    int b, int row) {
  const int page = min(max(kv.page_table[int64_t(b) * kv.pages_per_seq + row / kv.page_size], 0),
                       kv.cache_dim0 - 1);
  return int64_t(page) * cache.batch_stride + int64_t(row % kv.page_size) * cache.row_stride;
}

// Grid (row blocks, heads_kv, batch): warp w of block x takes new row x * kAppendWarps + w of
// sequence blockIdx.z.
template <class Element>
__global__ void __launch_bounds__(kAppendWarps * 32) append_kv_kernel(const AppendArgs a) {
  pdl_release();  // the attention kernel may start (Note [Overlapped launches])
  const int b = blockIdx.z;
  const int head = blockIdx.y;
  const int i = blockIdx.x * kAppendWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const KvCacheArgs& kv = a.kv;
  const int first = kv.cu_seqlens_new != nullptr ? kv.cu_seqlens_new[b] : 0;
  const int count = kv.cu_seqlens_new != nullptr ? kv.cu_seqlens_new[b + 1] - first
                                                 : kv.new_rows;
  if (i >= count) return;
  // Packed rows outside k_new (bad cu_seqlens_new) are not read.
  if (kv.cu_seqlens_new != nullptr && (first < 0 || int64_t(first) + i >= a.k_new_total_rows)) {
    return;
  }
  const int cached = kv.cache_seqlens != nullptr ? kv.cache_seqlens[b] : 0;
  const int64_t row64 = int64_t(cached) + i;  // the cache row it goes to
  if (row64 < 0 || row64 >= kv.capacity) return;  // past the cache: the attention clamps too
  const int row = int(row64);
  int64_t dst_offset;
  if (kv.page_table != nullptr) {
    dst_offset = paged_row_offset(kv, a.k_cache, b, row);
  } else {
    const int cache_row = kv.batch_idx != nullptr
                              ? min(max(kv.batch_idx[b], 0), kv.cache_dim0 - 1)
                              : min(b, kv.cache_dim0 - 1);
    dst_offset = int64_t(cache_row) * a.k_cache.batch_stride + int64_t(row) * a.k_cache.row_stride;
  }
  const int position = (a.rotary.start != nullptr ? a.rotary.start[b] : cached) + i;
  const int64_t src_row = kv.cu_seqlens_new != nullptr ? int64_t(first + i) : int64_t(i);
  const Element* k_src = static_cast<const Element*>(a.k_new.ptr) + b * a.k_new.batch_stride +
                         src_row * a.k_new.row_stride + head * a.k_new.head_stride;
  const Element* v_src = static_cast<const Element*>(a.v_new.ptr) + b * a.v_new.batch_stride +
                         src_row * a.v_new.row_stride + head * a.v_new.head_stride;
  // k_cache and v_cache share their strides (the op layer checks it).
  Element* k_dst = static_cast<Element*>(a.k_cache.ptr) + dst_offset +
                   head * a.k_cache.head_stride;
  Element* v_dst = static_cast<Element*>(a.v_cache.ptr) + dst_offset +
                   head * a.v_cache.head_stride;
  RotaryArgs none;
  for (int col = lane * 8; col < a.head_dim; col += 256) {
    rotate_chunk<Element>(k_src, k_dst, col, a.rotary, position);
    rotate_chunk<Element>(v_src, v_dst, col, none, 0);
  }
}

// Grid (row blocks, heads, batch): q rotated into q_out, row by row.
template <class Element>
__global__ void __launch_bounds__(kAppendWarps * 32) rotate_q_kernel(const RotateQArgs a) {
  pdl_release();  // the attention kernel may start (Note [Overlapped launches])
  const int b = blockIdx.z;
  const int head = blockIdx.y;
  const int i = blockIdx.x * kAppendWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const SeqlenInfo sq(a.seq_q, b);
  if (i >= sq.extent) return;
  const int cached = a.kv.cache_seqlens != nullptr ? a.kv.cache_seqlens[b] : 0;
  const int start = a.rotary.start != nullptr ? a.rotary.start[b] : cached;
  const int position = a.rotary.advance ? start + i : start;
  const int64_t row = sq.offset + i;
  const Element* src = static_cast<const Element*>(a.q.ptr) + b * a.q.batch_stride +
                       row * a.q.row_stride + head * a.q.head_stride;
  Element* dst = static_cast<Element*>(a.q_out.ptr) + b * a.q_out.batch_stride +
                 row * a.q_out.row_stride + head * a.q_out.head_stride;
  for (int col = lane * 8; col < a.head_dim; col += 256) {
    rotate_chunk<Element>(src, dst, col, a.rotary, position);
  }
}

// The q buffer a rotated q goes to (rows, heads, head_dim), dense rows, and its bytes.
inline TensorRef rotated_q_ref(const FwdParams& p, void* ptr) {
  TensorRef r;
  r.ptr = ptr;
  r.head_stride = p.head_dim;
  r.row_stride = int64_t(p.heads_q) * p.head_dim;
  r.batch_stride = p.seq_q.cu_seqlens != nullptr ? 0 : p.seq_q.seqlen * r.row_stride;
  return r;
}

// Appends the new keys and values, then rotates q into `q_out` (when rotary).
template <class Element>
cudaError_t append_and_rotate(const KvcacheParams& kp, Element* q_out, cudaStream_t stream) {
  const FwdParams& p = kp.fwd;
  if (p.batch == 0 || p.heads_kv == 0) return cudaSuccess;
  if (kp.k_new.ptr != nullptr) {
    AppendArgs a;
    a.k_new = kp.k_new;
    a.v_new = kp.v_new;
    a.k_cache = p.k;
    a.v_cache = p.v;
    a.kv = p.kv;
    a.rotary = kp.rotary;
    a.heads_kv = p.heads_kv;
    a.head_dim = p.head_dim;
    a.batch = p.batch;
    a.k_new_total_rows = kp.k_new_total_rows;
    // The most new rows of a sequence: dense, new_rows; packed, at most all of them.
    const int most = p.kv.cu_seqlens_new != nullptr ? kp.k_new_total_rows : p.kv.new_rows;
    if (most > 0) {
      const dim3 grid((most + kAppendWarps - 1) / kAppendWarps, p.heads_kv, p.batch);
      append_kv_kernel<Element><<<grid, kAppendWarps * 32, 0, stream>>>(a);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }
  if (q_out == nullptr) return cudaSuccess;
  RotateQArgs r;
  r.q = p.q;
  r.q_out = rotated_q_ref(p, q_out);
  const int64_t rows = p.seq_q.cu_seqlens != nullptr ? int64_t(p.seq_q.total_rows)
                                                   : int64_t(p.batch) * p.seq_q.seqlen;
  r.seq_q = p.seq_q;
  r.kv = p.kv;
  r.rotary = kp.rotary;
  r.heads = p.heads_q;
  r.head_dim = p.head_dim;
  const int most = p.seq_q.seqlen;  // dense: the seqlen; packed: max_seqlen_q
  if (rows == 0 || most == 0) return cudaSuccess;
  const dim3 grid((most + kAppendWarps - 1) / kAppendWarps, p.heads_q, p.batch);
  rotate_q_kernel<Element><<<grid, kAppendWarps * 32, 0, stream>>>(r);
  return cudaGetLastError();
}

}  // namespace flash_cuda
