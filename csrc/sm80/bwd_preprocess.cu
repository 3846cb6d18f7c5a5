// rowsum(dO * O) for every query row and head, the D term of dS = P * (dP - D).  Each lane reads
// one 16-byte chunk of dO and O; kLanesPerRow lanes (head dims up to 8 * kLanesPerRow) share a
// row, so a warp reads 32 / kLanesPerRow rows at once with every lane busy.  (One warp per row
// left 24 of 32 lanes idle at head dim 64: 2.4x FlashAttention-2's time for this pass,
// benchmarks/NOTES.md entry 19.)  The same blocks zero the dQ accumulator, each a contiguous
// slice (one pass fewer than a separate memset).
#include <cuda_runtime.h>

#include "common/launch_api.h"
#include "common/ptx.cuh"

namespace flash_cuda::sm80 {
namespace {

constexpr int kWarpsPerBlock = 8;

template <class Element, int kLanesPerRow> __global__ void __launch_bounds__(kWarpsPerBlock * 32)
    dot_do_o_kernel(const __grid_constant__ BwdParams p) {
  constexpr int kRowsPerWarp = 32 / kLanesPerRow;
  const FwdParams& f = p.fwd;
  {
    const int64_t vectors = p.dq_accum_floats / 4;  // rows are whole multiples of 8 floats
    const int64_t blocks = int64_t(gridDim.x) * gridDim.y;
    const int64_t per_block = (vectors + blocks - 1) / blocks;
    const int64_t begin = (int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * per_block;
    const int64_t end = begin + per_block < vectors ? begin + per_block : vectors;
    float4* zero = static_cast<float4*>(p.dq_accum.ptr);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32) * kRowsPerWarp +
                      lane / kLanesPerRow;
  const int head = blockIdx.y;
  const bool row_valid = row < p.total_rows_q;
  // Dense: row = b * seqlen + i.  Varlen: row is the packed row and batch strides are 0.
  const int64_t batch = f.seq_q.cu_seqlens != nullptr || !row_valid ? 0 : row / f.seq_q.seqlen;
  const int64_t i = f.seq_q.cu_seqlens != nullptr || !row_valid ? row : row % f.seq_q.seqlen;
  float acc = 0.f;
  const int col = (lane % kLanesPerRow) * 8;
  if (row_valid && col < f.head_dim) {
    const uint4 o = *reinterpret_cast<const uint4*>(static_cast<const Element*>(f.o.ptr) +
                                                    batch * f.o.batch_stride + i * f.o.row_stride +
                                                    head * f.o.head_stride + col);
    const uint4 d = *reinterpret_cast<const uint4*>(
        static_cast<const Element*>(p.dout.ptr) + batch * p.dout.batch_stride +
        i * p.dout.row_stride + head * p.dout.head_stride + col);
    const uint32_t ow[4] = {o.x, o.y, o.z, o.w};
    const uint32_t dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 a = unpack2<Element>(ow[w]);
      const float2 b = unpack2<Element>(dw[w]);
      acc += a.x * b.x + a.y * b.y;
    }
  }
#pragma unroll
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) {
    acc += __shfl_xor_sync(0xffffffff, acc, offset);
  }
  if (row_valid && lane % kLanesPerRow == 0) {
    p.dot_do_o.ptr[batch * p.dot_do_o.batch_stride + head * p.dot_do_o.head_stride + i] = acc;
  }
}

template <class Element, int kLanesPerRow>
void launch_preprocess(const BwdParams& params, cudaStream_t stream) {
  constexpr int kRowsPerBlock = kWarpsPerBlock * 32 / kLanesPerRow;
  const int64_t blocks = (params.total_rows_q + kRowsPerBlock - 1) / kRowsPerBlock;
  const dim3 grid(static_cast<unsigned>(blocks), params.fwd.heads_q);
  dot_do_o_kernel<Element, kLanesPerRow><<<grid, kWarpsPerBlock * 32, 0, stream>>>(params);
}

template <class Element> void launch_preprocess(const BwdParams& params, cudaStream_t stream) {
  const int d = params.fwd.head_dim;
  if (d <= 64) {
    launch_preprocess<Element, 8>(params, stream);
  } else if (d <= 128) {
    launch_preprocess<Element, 16>(params, stream);
  } else {
    launch_preprocess<Element, 32>(params, stream);
  }
}

}  // namespace

cudaError_t run_bwd_preprocess(const BwdParams& params, DType dtype, cudaStream_t stream) {
  if (params.total_rows_q == 0) return cudaSuccess;
  if (dtype == DType::kBFloat16) {
    launch_preprocess<__nv_bfloat16>(params, stream);
  } else {
    launch_preprocess<__half>(params, stream);
  }
  return cudaGetLastError();
}

}  // namespace flash_cuda::sm80
