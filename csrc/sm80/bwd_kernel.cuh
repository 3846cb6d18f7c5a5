// Portable attention backward: one block per (key tile, head, batch element, head-dim slice).
// It keeps its K and V tile in shared memory, walks the query tiles that see them, recomputes
// P from the saved lse, accumulates dK and dV in registers and adds its share of dQ to a float32
// buffer with atomics.
#pragma once

#include <cmath>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/seqlen_info.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/tile_config.h"

namespace flash_cuda::sm80 {

template <class ElementTag, int kHeadDim_>
struct BwdKernel {
  using Element = typename DeviceType<ElementTag>::type;
  using Config = BwdTileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNWarps = Config::kNWarps;
  static constexpr int kSlices = Config::kSlices;
  static constexpr int kStages = Config::kStages;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kSliceDim = kHeadDim / kSlices;  // dK/dV/dQ columns this block owns
  static constexpr int kQTiles = kBlockM / 8;           // n8 tiles of S^T (queries) per warp
  static constexpr int kSliceTiles = kSliceDim / 8;     // n8 tiles of dK / dV per warp
  // dQ = dS . K is tiled over the warps as kWarpsM (16 rows each) x kWarpsD column blocks.
  static constexpr int kWarpsM = kBlockM / 16;
  static constexpr int kWarpsD = kNWarps / kWarpsM;
  static constexpr int kDqCols = kSliceDim / kWarpsD;
  // dQ columns per GEMM pass: at most 64, so the pass's 32 accumulators fit beside dK and dV.
  static constexpr int kDqChunk = kDqCols > 64 ? kDqCols / 2 : kDqCols;
  static constexpr int kPitch = PaddedRows<kHeadDim>::kPitch;
  static constexpr int kDsPitch = PaddedRows<kBlockM>::kPitch;
  static_assert(kBlockN == 16 * kNWarps, "each warp owns 16 keys");
  static_assert(kNWarps % kWarpsM == 0 && kDqCols % kDqChunk == 0 && kDqChunk % 16 == 0,
                "dQ tiles must cover the slice");
  static_assert(kSliceDim % 16 == 0, "slices are whole k16 steps");

  struct SharedStorage {
    Element k[kBlockN * kPitch];            // (kBlockN, kHeadDim) padded
    Element v[kBlockN * kPitch];            // (kBlockN, kHeadDim) padded
    Element q[kStages][kBlockM * kPitch];   // (kBlockM, kHeadDim) padded, per stage
    Element dout[kStages][kBlockM * kPitch];
    Element ds[kBlockN * kDsPitch];         // dS^T (kBlockN, kBlockM) padded
    alignas(8) float lse_log2[kStages][kBlockM];  // lse * log2(e); 0 for rows that see nothing
    alignas(8) float dot_do_o[kStages][kBlockM];  // rowsum(dO * O)
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= kMaxSmemBytesSm80, "the tile config must fit an sm80 block");

  struct Tile {  // where this block's operands live
    const Element *gq, *gdo, *gk, *gv;
    const float *lse, *dot;
    float* gdq;
    int head, head_kv, batch, slice, n0;
  };

  // acc[nt] (16 keys x kBlockM queries, m16n8 layout) += A[warp's 16 rows] . B^T, both operands
  // (rows, kHeadDim) in smem: S^T = K Q^T and dP^T = V dO^T.
  static __device__ __forceinline__ void gemm_rows_t(float (&acc)[kQTiles][4], const Element* sa,
                                                     const Element* sb, int warp, int lane) {
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      uint32_t a[4];
      ldmatrix_x4(a, sa + (warp * 16 + lane % 16) * kPitch + ks * 16 + (lane / 16) * 8);
#pragma unroll
      for (int np = 0; np < kQTiles / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, sb + (np * 16 + (lane / 16) * 8 + lane % 8) * kPitch + ks * 16 +
                           ((lane / 8) % 2) * 8);
        mma_16816<Element>(acc[2 * np], a, b[0], b[1]);
        mma_16816<Element>(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
  }

  // acc (16 keys x slice) += X^T[warp's keys] . B[:, slice], X^T in registers (m16n8 layout,
  // reused as the A operand) and B (kBlockM, kHeadDim) in smem: dV += P^T dO, dK += dS^T Q.
  static __device__ __forceinline__ void gemm_reg_a(float (&acc)[kSliceTiles][4],
                                                    const float (&x)[kQTiles][4],
                                                    const Element* sb, int col0, int lane) {
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack2<Element>(x[2 * kk][0], x[2 * kk][1]);
      a[1] = pack2<Element>(x[2 * kk][2], x[2 * kk][3]);
      a[2] = pack2<Element>(x[2 * kk + 1][0], x[2 * kk + 1][1]);
      a[3] = pack2<Element>(x[2 * kk + 1][2], x[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < kSliceTiles / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sb + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kPitch + col0 +
                                 dp * 16 + (lane / 16) * 8);
        mma_16816<Element>(acc[2 * dp], a, b[0], b[1]);
        mma_16816<Element>(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

  // dQ tile (16 queries x kDqCols) = dS . K[:, cols]; dS^T is (keys, queries) in smem.
  static __device__ __forceinline__ void gemm_dq(float (&acc)[kDqChunk / 8][4], const Element* sds,
                                                 const Element* sk, int row0, int col0, int lane) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      // Matrices: keys 0-7 | q 0-7, keys 0-7 | q 8-15, keys 8-15 | q 0-7, keys 8-15 | q 8-15,
      // each transposed into the (query, key) A layout.
      uint32_t a[4];
      ldmatrix_x4_trans(a, sds + (kk * 16 + (lane / 16) * 8 + lane % 8) * kDsPitch + row0 +
                               ((lane / 8) % 2) * 8);
#pragma unroll
      for (int dp = 0; dp < kDqChunk / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, sk + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kPitch + col0 +
                                 dp * 16 + (lane / 16) * 8);
        mma_16816<Element>(acc[2 * dp], a, b[0], b[1]);
        mma_16816<Element>(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

  // Masks S^T outside the queries each of this thread's two keys is seen by; the range is
  // computed once per key so the per-element test is one compare.
  static __device__ __forceinline__ void apply_mask(float (&s)[kQTiles][4], const MaskInfo& mask,
                                                    int key0, int q0, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int lo, hi;
      mask.visible_queries(key0 + lane / 4 + r * 8, lo, hi);
      lo -= q0 + (lane % 4) * 2;
      hi -= q0 + (lane % 4) * 2;
#pragma unroll
      for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + e;
          if (c < lo || c >= hi) s[nt][2 * r + e] = -INFINITY;
        }
    }
  }

  static __device__ void load_query_tile(const BwdParams& p, SharedStorage& smem,
                                         const Tile& t, const SeqlenInfo& sq, int m, int stage);
  static __device__ void process_query_tile(const BwdParams& p, SharedStorage& smem,
                                            const Tile& t, const MaskInfo& mask,
                                            const SeqlenInfo& sq, int m, int stage,
                                            bool has_next, float (&dk)[kSliceTiles][4],
                                            float (&dv)[kSliceTiles][4]);
  static __device__ void run(const BwdParams& p, SharedStorage& smem);
};

// Starts the copies of query tile m (Q, dO) and fills its lse / rowsum(dO*O) entries.
template <class ElementTag, int kHeadDim>
__device__ void BwdKernel<ElementTag, kHeadDim>::load_query_tile(const BwdParams& p,
                                                                 SharedStorage& smem,
                                                                 const Tile& t,
                                                                 const SeqlenInfo& sq, int m,
                                                                 int stage) {
  const int m0 = m * kBlockM;
  const int rows = sq.len - m0;  // rows past the used length are zero-filled (see the forward)
  load_tile_async<kBlockM, kHeadDim, kThreads>(smem.q[stage], t.gq + int64_t(m0) * p.fwd.q.row_stride,
                                               p.fwd.q.row_stride, rows, p.fwd.head_dim);
  load_tile_async<kBlockM, kHeadDim, kThreads>(smem.dout[stage], t.gdo + int64_t(m0) * p.dout.row_stride,
                                               p.dout.row_stride, rows, p.fwd.head_dim);
  cp_async_commit();
  for (int i = threadIdx.x; i < kBlockM; i += kThreads) {
    const bool used = m0 + i < sq.len;
    const float lse = used ? t.lse[m0 + i] : -INFINITY;
    // A row that sees no key has lse -inf and all scores masked: 0 keeps exp2(-inf - 0) = 0.
    smem.lse_log2[stage][i] = lse == -INFINITY ? 0.f : lse * float(M_LOG2E);
    smem.dot_do_o[stage][i] = used ? t.dot[m0 + i] : 0.f;
  }
}

template <class ElementTag, int kHeadDim>
__device__ void BwdKernel<ElementTag, kHeadDim>::process_query_tile(
    const BwdParams& p, SharedStorage& smem, const Tile& t, const MaskInfo& mask,
    const SeqlenInfo& sq, int m, int stage, bool has_next, float (&dk)[kSliceTiles][4],
    float (&dv)[kSliceTiles][4]) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int m0 = m * kBlockM;
  const int col0 = t.slice * kSliceDim;
  const float scale_log2 = p.fwd.softmax_scale * float(M_LOG2E);

  float s[kQTiles][4];  // S^T, then P^T
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  gemm_rows_t(s, smem.k, smem.q[stage], warp, lane);
  if (!mask.tile_all_visible(m0, kBlockM, t.n0, kBlockN)) {
    apply_mask(s, mask, t.n0 + warp * 16, m0, lane);
  }
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
    const float2 lse = *reinterpret_cast<const float2*>(&smem.lse_log2[stage][nt * 8 + (lane % 4) * 2]);
    s[nt][0] = fast_exp2(s[nt][0] * scale_log2 - lse.x);
    s[nt][1] = fast_exp2(s[nt][1] * scale_log2 - lse.y);
    s[nt][2] = fast_exp2(s[nt][2] * scale_log2 - lse.x);
    s[nt][3] = fast_exp2(s[nt][3] * scale_log2 - lse.y);
  }

  float dp[kQTiles][4];  // dP^T, then dS^T
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
  gemm_rows_t(dp, smem.v, smem.dout[stage], warp, lane);
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
    const float2 dot = *reinterpret_cast<const float2*>(&smem.dot_do_o[stage][nt * 8 + (lane % 4) * 2]);
    dp[nt][0] = s[nt][0] * (dp[nt][0] - dot.x);
    dp[nt][1] = s[nt][1] * (dp[nt][1] - dot.y);
    dp[nt][2] = s[nt][2] * (dp[nt][2] - dot.x);
    dp[nt][3] = s[nt][3] * (dp[nt][3] - dot.y);
  }

  gemm_reg_a(dv, s, smem.dout[stage], col0, lane);
  gemm_reg_a(dk, dp, smem.q[stage], col0, lane);

  // dS^T goes to smem: dQ needs it with queries as rows, spread over other warps.
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      *reinterpret_cast<uint32_t*>(smem.ds + (warp * 16 + lane / 4 + r * 8) * kDsPitch + nt * 8 +
                                   (lane % 4) * 2) = pack2<Element>(dp[nt][2 * r], dp[nt][2 * r + 1]);
    }
  __syncthreads();  // dS^T complete; every warp is also done reading Q / dO of this stage
  if (kStages == 1 && has_next) {
    // With one stage the next tile may only land now; it overlaps the dQ GEMM below.
    load_query_tile(p, smem, t, sq, m + 1, 0);
  }

  const int wm = warp % kWarpsM;
  const int wd = warp / kWarpsM;
  // Rows past the used queries and columns past the head dim get nothing; whole tiles (the
  // common case) skip the per-element test.
  const int row0 = m0 + wm * 16 + lane / 4;
  const bool whole_tile = m0 + kBlockM <= sq.len && col0 + kSliceDim <= p.fwd.head_dim;
  float* dq_row0 = t.gdq + int64_t(row0) * p.dq_accum.row_stride + (lane % 4) * 2;
  float* dq_row8 = dq_row0 + 8 * p.dq_accum.row_stride;
#pragma unroll
  for (int chunk0 = col0 + wd * kDqCols; chunk0 < col0 + (wd + 1) * kDqCols; chunk0 += kDqChunk) {
    float dq[kDqChunk / 8][4];
#pragma unroll
    for (int dt = 0; dt < kDqChunk / 8; ++dt) dq[dt][0] = dq[dt][1] = dq[dt][2] = dq[dt][3] = 0.f;
    gemm_dq(dq, smem.ds, smem.k, wm * 16, chunk0, lane);
#pragma unroll
    for (int dt = 0; dt < kDqChunk / 8; ++dt) {
      const int col = chunk0 + dt * 8;  // + (lane % 4) * 2, folded into dq_row*
      if (whole_tile || (row0 < sq.len && col + (lane % 4) * 2 < p.fwd.head_dim)) {
        red_add_f32x2(dq_row0 + col, dq[dt][0], dq[dt][1]);
      }
      if (whole_tile || (row0 + 8 < sq.len && col + (lane % 4) * 2 < p.fwd.head_dim)) {
        red_add_f32x2(dq_row8 + col, dq[dt][2], dq[dt][3]);
      }
    }
  }
}

template <class ElementTag, int kHeadDim>
__device__ void BwdKernel<ElementTag, kHeadDim>::run(const BwdParams& p, SharedStorage& smem) {
  const FwdParams& f = p.fwd;
  Tile t;
  t.head = blockIdx.y;
  t.batch = blockIdx.z / kSlices;
  t.slice = blockIdx.z % kSlices;
  t.n0 = blockIdx.x * kBlockN;
  t.head_kv = t.head / (f.heads_q / f.heads_kv);
  const SeqlenInfo sq(f.seq_q, t.batch);
  const SeqlenInfo sk(f.seq_k, t.batch);
  if (t.n0 >= sk.extent) return;
  const MaskInfo mask(sq.len, sk.len, f.window_left, f.window_right);
  int m_begin, m_end;
  mask.query_block_range(t.n0, kBlockN, kBlockM, m_begin, m_end);

  const int64_t q_row0 = sq.offset, k_row0 = int64_t(sk.offset) + t.n0;
  t.gq = static_cast<const Element*>(f.q.ptr) + t.batch * f.q.batch_stride +
         q_row0 * f.q.row_stride + t.head * f.q.head_stride;
  t.gdo = static_cast<const Element*>(p.dout.ptr) + t.batch * p.dout.batch_stride +
          q_row0 * p.dout.row_stride + t.head * p.dout.head_stride;
  t.gk = static_cast<const Element*>(f.k.ptr) + t.batch * f.k.batch_stride +
         k_row0 * f.k.row_stride + t.head_kv * f.k.head_stride;
  t.gv = static_cast<const Element*>(f.v.ptr) + t.batch * f.v.batch_stride +
         k_row0 * f.v.row_stride + t.head_kv * f.v.head_stride;
  t.lse = f.lse.ptr + t.batch * f.lse.batch_stride + t.head * f.lse.head_stride + sq.offset;
  t.dot = p.dot_do_o.ptr + t.batch * p.dot_do_o.batch_stride + t.head * p.dot_do_o.head_stride +
          sq.offset;
  t.gdq = static_cast<float*>(p.dq_accum.ptr) + t.batch * p.dq_accum.batch_stride +
          q_row0 * p.dq_accum.row_stride + t.head * p.dq_accum.head_stride;

  float dk[kSliceTiles][4], dv[kSliceTiles][4];
#pragma unroll
  for (int dt = 0; dt < kSliceTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  if (m_begin < m_end) {
    load_tile_async<kBlockN, kHeadDim, kThreads>(smem.k, t.gk, f.k.row_stride, sk.len - t.n0,
                                                 f.head_dim);
    load_tile_async<kBlockN, kHeadDim, kThreads>(smem.v, t.gv, f.v.row_stride, sk.len - t.n0,
                                                 f.head_dim);
    load_query_tile(p, smem, t, sq, m_begin, 0);
    for (int m = m_begin; m < m_end; ++m) {
      const int stage = kStages == 1 ? 0 : (m - m_begin) % kStages;
      // Tile m landed (and its lse); all warps are done with tile m-1, whose stage and dS^T
      // buffer are now free.
      cp_async_wait<0>();
      __syncthreads();
      if (kStages == 2 && m + 1 < m_end) load_query_tile(p, smem, t, sq, m + 1, stage ^ 1);
      process_query_tile(p, smem, t, mask, sq, m, stage, m + 1 < m_end, dk, dv);
    }
  }

  // dK = scale * dS^T Q; rows past the sequence's used keys hold zeros and are written too.
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int col0 = t.slice * kSliceDim;
  Element* gdk = static_cast<Element*>(p.dk.ptr) + t.batch * p.dk.batch_stride +
                 k_row0 * p.dk.row_stride + t.head * p.dk.head_stride;
  Element* gdv = static_cast<Element*>(p.dv.ptr) + t.batch * p.dv.batch_stride +
                 k_row0 * p.dv.row_stride + t.head * p.dv.head_stride;
#pragma unroll
  for (int dt = 0; dt < kSliceTiles; ++dt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp * 16 + lane / 4 + r * 8;
      const int col = col0 + dt * 8 + (lane % 4) * 2;
      if (t.n0 + row < sk.extent && col < f.head_dim) {
        *reinterpret_cast<uint32_t*>(gdk + int64_t(row) * p.dk.row_stride + col) = pack2<Element>(
            dk[dt][2 * r] * f.softmax_scale, dk[dt][2 * r + 1] * f.softmax_scale);
        *reinterpret_cast<uint32_t*>(gdv + int64_t(row) * p.dv.row_stride + col) =
            pack2<Element>(dv[dt][2 * r], dv[dt][2 * r + 1]);
      }
    }
}

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads) bwd_kernel(const __grid_constant__ BwdParams params) {
  extern __shared__ __align__(16) char smem_buf[];
  Kernel::run(params, *reinterpret_cast<typename Kernel::SharedStorage*>(smem_buf));
}

}  // namespace flash_cuda::sm80
