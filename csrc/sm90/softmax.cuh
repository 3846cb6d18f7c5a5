// The online softmax on wgmma accumulators (Hopper family): the (row, column) view of an
// accumulator fragment, the per-row running maximum and sum, and the fragment conversions
// between S (fp32 accumulator) and P (16-bit A operand of the next wgmma).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cmath>

#include "common/row_reduce.cuh"

namespace flash_cuda::sm90 {

// A wgmma m64nN fp32 accumulator fragment has the layout ((2, 2, N / 8), MMA_M, MMA_N): two
// adjacent columns, rows r and r + 8, then the N / 8 column blocks.  As (rows, columns):
// ((2, MMA_M), (2, N / 8, MMA_N)), so that a thread's rows are mode 0 and its columns mode 1.
template <class Layout> __device__ __forceinline__ constexpr auto rowcol(Layout layout) {
  using namespace cute;
  static_assert(rank(Layout{}) == 3 && rank<0>(Layout{}) == 3, "a wgmma accumulator layout");
  auto l0 = get<0>(layout);
  return make_layout(make_layout(get<1>(l0), get<1>(layout)),
                     make_layout(get<0>(l0), get<2>(l0), get<2>(layout)));
}

// The same registers as the A operand of a register-sourced wgmma with K = N: its fragment is
// ((2, 2, 2), MMA_M, N / 16), the pairs of 8-column blocks of the accumulator.
template <class Layout> __device__ __forceinline__ constexpr auto accumulator_as_a(Layout layout) {
  using namespace cute;
  static_assert(size<2>(Layout{}) == 1, "one accumulator atom along N");
  auto l0 = logical_divide(get<0>(layout), Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l0), get<1>(l0), get<2, 0>(l0)), get<1>(layout),
                     get<2, 1>(l0));
}

// dst = src converted element-wise (both register tensors of the same size).
template <class DstTensor, class SrcTensor>
__device__ __forceinline__ void convert_into(DstTensor& dst, const SrcTensor& src) {
  using namespace cute;
  using To = typename DstTensor::value_type;
  using From = typename SrcTensor::value_type;
  constexpr int kN = decltype(size(src))::value;
  static_assert(decltype(size(dst))::value == kN);
  using Converter = cutlass::NumericArrayConverter<To, From, kN>;
  *reinterpret_cast<cutlass::Array<To, kN>*>(dst.data()) =
      Converter{}(*reinterpret_cast<const cutlass::Array<From, kN>*>(src.data()));
}

// Row statistics of kRows rows.  Scores are kept unscaled; exp2((s - max) * scale_log2) is one
// FFMA and one MUFU.EX2 per element.  The row sums stay per thread (each thread's share of its
// columns) until finish(): the corrections are the same for the four threads of a row.
template <int kRows> struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float correction[kRows];
  float scale_log2;

  __device__ __forceinline__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
      correction[r] = 1.f;
    }
  }

  // Takes one block of scores s (rows x columns view, masked entries -inf) in place to
  // P = exp2((s - new max) * scale_log2) and sets correction[] = exp2((old - new max) * ...),
  // the factor O and the row sums must be scaled by.  A row with no visible key yet keeps the
  // maximum -inf, and its P and correction are 0 (never NaN).
  template <bool kFirst, class Tensor> __device__ __forceinline__ void step(Tensor& s) {
    using namespace cute;
    static_assert(decltype(size<0>(s))::value == kRows);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) mx = fmaxf(mx, s(r, c));
      mx = quad_max(mx);
      const float mx_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
      correction[r] = kFirst ? 0.f : exp2f(row_max[r] * scale_log2 - mx_scaled);
      row_max[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(s(r, c) * scale_log2 - mx_scaled);
        sum += s(r, c);
      }
      row_sum[r] = kFirst ? sum : row_sum[r] * correction[r] + sum;
    }
  }

  template <class Tensor> __device__ __forceinline__ void rescale(Tensor& o) const {
    using namespace cute;
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
  }

  // Normalises O by the row sums and returns each row's lse (natural log) in lse[]: rows that
  // saw no key get O = 0 and lse = -inf.
  template <class Tensor>
  __device__ __forceinline__ void finish(Tensor& o, float softmax_scale, float (&lse)[kRows]) {
    using namespace cute;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool seen = sum > 0.f;
      lse[r] = seen ? row_max[r] * softmax_scale + logf(sum) : -INFINITY;
      const float inv = seen ? 1.f / sum : 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= inv;
    }
  }
};

}  // namespace flash_cuda::sm90
