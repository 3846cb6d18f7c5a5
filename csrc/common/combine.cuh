// The combine of split-KV partial results, for every family: each (row, head) of the output
// merges its splits' float32 O and lse (common/params.h, SplitArgs) into O in the output dtype
// and its lse.  Split s weighs exp(lse_s - lse) with lse = log(sum_s exp(lse_s)); a split with
// lse -inf weighs nothing whatever its O holds, and a row no split saw gets O = 0, lse = -inf.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/launch_api.h"
#include "common/params.h"
#include "common/ptx.cuh"
#include "common/seqlen_info.cuh"

namespace flash_cuda {

constexpr int kCombineMaxSplits = 256;
constexpr int kCombineWarps = 4;

// Grid of combine_kernel: one block per (row, head) of a sequence (x over seq_q.seqlen x heads),
// y the batch.
inline dim3 combine_grid(int64_t rows_times_heads, int batch) {
  return dim3(unsigned(rows_times_heads), unsigned(batch));
}

// A block of kCombineWarps warps merges one (row, head): every warp weighs all splits (lane l
// holds the lse of splits l, l + 32, ...), warp w sums the O of splits w, w + kCombineWarps, ...
// (lane l the 4-float chunks l, l + 32 of the row), and warp 0 adds the warps' sums.  Few rows
// (a decode step of batch 1: 32) over many splits are then spread over as many warps as the
// splits allow, each with its loads in flight together (benchmarks/NOTES.md entry 82).
template <class Element>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const CombineArgs a) {
  __shared__ float4 sums[kCombineWarps - 1][kCombineMaxHeadDim / 4];
  pdl_wait();  // the partials' kernel may still be running (Note [Overlapped launches])
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int batch = blockIdx.y;
  const int row_in_seq = int(blockIdx.x / unsigned(a.heads));
  const int head = int(blockIdx.x % unsigned(a.heads));
  const SeqlenInfo sq(a.seq_q, batch);
  if (row_in_seq >= sq.extent) return;  // the whole block: no barrier is skipped
  const int i = sq.offset + row_in_seq;  // the row in q's (packed) rows
  const SplitArgs& sp = a.split;
  const int splits = sp.num_splits;
  const float* lse_row = sp.lse + batch * sp.lse_batch_stride + i * sp.lse_row_stride +
                         head * sp.lse_head_stride;
  constexpr int kPerLane = kCombineMaxSplits / 32;
  float lse_s[kPerLane];
  float top = -INFINITY;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int s = lane + 32 * j;
    lse_s[j] = s < splits ? lse_row[s * sp.lse_split_stride] : -INFINITY;
    top = fmaxf(top, lse_s[j]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, offset));
  }
  const float safe_top = top == -INFINITY ? 0.f : top;
  float total = 0.f;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    lse_s[j] = lse_s[j] == -INFINITY ? 0.f : expf(lse_s[j] - safe_top);  // now the weight
    total += lse_s[j];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    total += __shfl_xor_sync(0xffffffff, total, offset);
  }
  const float inv_total = total > 0.f ? 1.f / total : 0.f;

  const float* o_row = sp.o + batch * sp.o_batch_stride + i * sp.o_row_stride +
                       head * sp.o_head_stride;
  // This warp's splits of group j are 32 j + warp + kCombineWarps u, u < kPerWarp: their loads
  // are issued before any is used.  Loads are unconditional (a branch per load keeps ptxas from
  // grouping them): a split past the last reads the last one's O and a column past the head dim
  // column 0, both weighed 0 or not stored.  A split of weight 0 is read but not used, since its
  // O may hold anything.
  constexpr int kPerWarp = 32 / kCombineWarps;
  float4 acc[kCombineMaxHeadDim / 128];
#pragma unroll
  for (int c = 0; c < kCombineMaxHeadDim / 128; ++c) {
    acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    const int col = c * 128 + lane * 4;
    if (c * 128 >= a.head_dim) break;
    const bool active = col < a.head_dim;  // head dims are multiples of 4
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      if (32 * j + warp >= splits) break;
      float4 v[kPerWarp];
#pragma unroll
      for (int u = 0; u < kPerWarp; ++u) {
        const int s = min(32 * j + warp + kCombineWarps * u, splits - 1);
        v[u] = *reinterpret_cast<const float4*>(o_row + int64_t(s) * sp.o_split_stride +
                                                (active ? col : 0));
      }
#pragma unroll
      for (int u = 0; u < kPerWarp; ++u) {
        const float w = __shfl_sync(0xffffffff, lse_s[j], warp + kCombineWarps * u);
        if (w != 0.f) {
          acc[c].x += w * v[u].x;
          acc[c].y += w * v[u].y;
          acc[c].z += w * v[u].z;
          acc[c].w += w * v[u].w;
        }
      }
    }
    if (warp > 0) sums[warp - 1][c * 32 + lane] = acc[c];
  }
  __syncthreads();
  if (warp != 0) return;
  Element* out = static_cast<Element*>(a.o.ptr) + batch * a.o.batch_stride +
                 int64_t(i) * a.o.row_stride + head * a.o.head_stride;
#pragma unroll
  for (int c = 0; c < kCombineMaxHeadDim / 128; ++c) {
    const int col = c * 128 + lane * 4;
    if (col >= a.head_dim) break;
    float4 t = acc[c];
#pragma unroll
    for (int w = 0; w < kCombineWarps - 1; ++w) {
      const float4 o = sums[w][c * 32 + lane];
      t.x += o.x;
      t.y += o.y;
      t.z += o.z;
      t.w += o.w;
    }
    uint2 packed;
    packed.x = pack2<Element>(t.x * inv_total, t.y * inv_total);
    packed.y = pack2<Element>(t.z * inv_total, t.w * inv_total);
    *reinterpret_cast<uint2*>(out + col) = packed;
  }
  if (lane == 0) {
    a.lse.ptr[batch * a.lse.batch_stride + head * a.lse.head_stride + i] =
        total > 0.f ? safe_top + logf(total) : -INFINITY;
  }
}

}  // namespace flash_cuda
