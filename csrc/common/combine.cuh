// The combine of split-KV partial results, for every family: each (row, head) of the output
// merges its splits' float32 O and lse (common/params.h, SplitArgs) into O in the output dtype
// and its lse.  Split s weighs exp(lse_s - lse) with lse = log(sum_s exp(lse_s)); a split with
// lse -inf weighs nothing whatever its O holds, and a row no split saw gets O = 0, lse = -inf.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/seqlen_info.cuh"

namespace flash_cuda {

constexpr int kCombineMaxSplits = 128;
constexpr int kCombineWarps = 4;

// Grid (row blocks over seq_q.seqlen x heads, batch): one warp per (row, head) of a sequence;
// lane l holds the lse of splits l, l + 32, ... and 4-float chunks l, l + 32 of O's row.
template <class Element>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(const CombineArgs a) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int batch = blockIdx.y;
  const int64_t item = int64_t(blockIdx.x) * kCombineWarps + warp;
  const int row_in_seq = int(item / a.heads);
  const int head = int(item % a.heads);
  const SeqlenInfo sq(a.seq_q, batch);
  if (row_in_seq >= sq.extent) return;
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
  Element* out = static_cast<Element*>(a.o.ptr) + batch * a.o.batch_stride +
                 int64_t(i) * a.o.row_stride + head * a.o.head_stride;
  // Every lane runs every iteration: the weights are broadcast with shuffles.
  for (int col0 = 0; col0 < a.head_dim; col0 += 128) {
    const int col = col0 + lane * 4;
    const bool active = col < a.head_dim;  // head dims are multiples of 8
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      for (int t = 0; t < 32 && 32 * j + t < splits; ++t) {
        const float w = __shfl_sync(0xffffffff, lse_s[j], t);  // split 32 j + t's weight
        if (!active || w == 0.f) continue;  // an unseen split's O may hold anything
        const float4 v = *reinterpret_cast<const float4*>(
            o_row + int64_t(32 * j + t) * sp.o_split_stride + col);
        acc[0] += w * v.x;
        acc[1] += w * v.y;
        acc[2] += w * v.z;
        acc[3] += w * v.w;
      }
    }
    if (active) {
      uint2 packed;
      packed.x = pack2<Element>(acc[0] * inv_total, acc[1] * inv_total);
      packed.y = pack2<Element>(acc[2] * inv_total, acc[3] * inv_total);
      *reinterpret_cast<uint2*>(out + col) = packed;
    }
  }
  if (lane == 0) {
    a.lse.ptr[batch * a.lse.batch_stride + head * a.lse.head_stride + i] =
        total > 0.f ? safe_top + logf(total) : -INFINITY;
  }
}

}  // namespace flash_cuda
