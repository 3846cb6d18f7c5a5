// Sequence geometry of one batch element and the key/query block ranges a tile must visit.
// Shared by forward and backward, dense and varlen, so that masking rules live in one place.
#pragma once

#include "common/params.h"

namespace flash_cuda {

// Rows of one sequence: `offset` is its first row in the (packed) tensor, `extent` the rows that
// belong to it (all written by the kernels), `len` the rows that take part (<= extent).
struct SeqlenInfo {
  int offset;
  int extent;
  int len;

  __device__ __forceinline__ SeqlenInfo(const SeqArgs& args, int batch_idx) {
    if (args.cu_seqlens != nullptr) {
      // Clamped to the packed tensor: cu_seqlens live on the GPU, where checking their values
      // would cost a sync, so bad values must not turn into out-of-bounds accesses.
      offset = min(max(args.cu_seqlens[batch_idx], 0), args.total_rows);
      extent = max(0, min(args.cu_seqlens[batch_idx + 1], args.total_rows) - offset);
    } else {
      offset = 0;
      extent = args.seqlen;
    }
    // seqused is clamped to the sequence (the CPU reference rejects values outside it).
    len = args.seqused != nullptr ? max(0, min(args.seqused[batch_idx], extent)) : extent;
  }

  // The keys of sequence b of a KV cache (common/params.h, KvCacheArgs): its rows from leftpad
  // through the new ones, counted from the leftpad row (offset 0), clamped to the capacity.
  __device__ __forceinline__ SeqlenInfo(const KvCacheArgs& kv, int batch_idx) {
    const int new_rows = kv.cu_seqlens_new != nullptr
                             ? kv.cu_seqlens_new[batch_idx + 1] - kv.cu_seqlens_new[batch_idx]
                             : kv.new_rows;
    const int cached = kv.cache_seqlens != nullptr ? kv.cache_seqlens[batch_idx] : kv.capacity;
    const int end =
        int(min(max(int64_t(cached) + max(new_rows, 0), int64_t(0)), int64_t(kv.capacity)));
    const int pad = kv.leftpad != nullptr ? min(max(kv.leftpad[batch_idx], 0), end) : 0;
    offset = pad;
    extent = end - pad;
    len = extent;
  }
};

__device__ __forceinline__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
__device__ __forceinline__ int floor_div(int a, int b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// The visibility rule (bottom-right aligned, as FlashAttention defines it): query row i sees key
// j iff 0 <= j < len_k, i < len_q, j >= i + diag - window_left (when window_left >= 0) and
// j <= i + diag + window_right (when window_right >= 0), with diag = len_k - len_q.
struct MaskInfo {
  int len_q;
  int len_k;
  int diag;
  int window_left;
  int window_right;

  __device__ __forceinline__ MaskInfo(int len_q_, int len_k_, int left, int right)
      : len_q(len_q_),
        len_k(len_k_),
        diag(len_k_ - len_q_),
        window_left(left),
        window_right(right) {}

  __device__ __forceinline__ bool visible(int i, int j) const {
    return j < len_k && i < len_q && (window_left < 0 || j >= i + diag - window_left) &&
           (window_right < 0 || j <= i + diag + window_right);
  }

  // Keys [lo, hi) that row i sees (empty when lo >= hi).
  __device__ __forceinline__ void visible_keys(int i, int& lo, int& hi) const {
    lo = window_left >= 0 ? i + diag - window_left : 0;
    hi = window_right >= 0 ? min(len_k, i + diag + window_right + 1) : len_k;
    if (i >= len_q) hi = lo;
  }

  // Queries [lo, hi) that see key j (empty when lo >= hi).
  __device__ __forceinline__ void visible_queries(int j, int& lo, int& hi) const {
    lo = window_right >= 0 ? max(0, j - diag - window_right) : 0;
    hi = window_left >= 0 ? min(len_q, j - diag + window_left + 1) : len_q;
    if (j >= len_k) hi = lo;
  }

  // True when every (i, j) of rows [m0, m0 + bm) x keys [n0, n0 + bn) is visible: such tiles
  // skip the per-element mask.
  __device__ __forceinline__ bool tile_all_visible(int m0, int bm, int n0, int bn) const {
    return n0 + bn <= len_k && m0 + bm <= len_q &&
           (window_left < 0 || n0 >= m0 + bm - 1 + diag - window_left) &&
           (window_right < 0 || n0 + bn - 1 <= m0 + diag + window_right);
  }

  // Key blocks [begin, end) of size bn for which tile_all_visible(m0, bm, n * bn, bn) holds:
  // one run, empty (begin >= end) when none does.
  __device__ __forceinline__ void all_visible_block_range(int m0, int bm, int bn, int& begin,
                                                          int& end) const {
    begin = 0;
    end = m0 + bm <= len_q ? len_k / bn : 0;
    if (window_left >= 0) begin = max(0, floor_div(m0 + bm - 1 + diag - window_left + bn - 1, bn));
    if (window_right >= 0) end = min(end, floor_div(m0 + diag + window_right + 1, bn));
  }

  // Key blocks [begin, end) of size bn that rows [m0, m0 + bm) can see; empty when begin >= end.
  __device__ __forceinline__ void key_block_range(int m0, int bm, int bn, int& begin,
                                                  int& end) const {
    const int rows_end = min(m0 + bm, len_q);  // rows past len_q see nothing
    end = ceil_div(len_k, bn);
    if (window_right >= 0) end = min(end, floor_div(rows_end - 1 + diag + window_right, bn) + 1);
    begin = window_left >= 0 ? max(0, floor_div(m0 + diag - window_left, bn)) : 0;
    if (rows_end <= m0) end = begin;
  }

  // Query blocks [begin, end) of size bm that keys [n0, n0 + bn) are seen by.
  __device__ __forceinline__ void query_block_range(int n0, int bn, int bm, int& begin,
                                                    int& end) const {
    const int keys_end = min(n0 + bn, len_k);
    end = ceil_div(len_q, bm);
    if (window_left >= 0) end = min(end, floor_div(keys_end - 1 - diag + window_left, bm) + 1);
    begin = window_right >= 0 ? max(0, floor_div(n0 - diag - window_right, bm)) : 0;
    if (keys_end <= n0) end = begin;
  }
};

}  // namespace flash_cuda
