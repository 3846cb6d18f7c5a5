// Portable attention backward: one block per (key tile, head, batch element).  It keeps its K
// and V tile in shared memory, walks the query tiles that see them, recomputes P from the saved
// lse, accumulates dK and dV in registers and adds its share of dQ to a float32 buffer with
// atomics; a second kernel converts that buffer to dQ.  The softmax scale is folded into dS, so
// dK and dQ come out scaled.
#pragma once

#include <cmath>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/seqlen_info.cuh"
#include "common/tile_order.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/tile_config.h"
#include "sm80/warp_gemm.cuh"

namespace flash_cuda::sm80 {

template <class ElementTag, int kHeadDim_, class Config_> struct BwdKernel {
  using Element = typename DeviceType<ElementTag>::type;
  using Config = Config_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNWarps = Config::kNWarps;
  static constexpr int kStagesQ = Config::kStagesQ;
  static constexpr int kStagesDo = Config::kStagesDo;
  static constexpr int kThreads = kNWarps * 32;
  // Warp tiles of the three GEMM shapes.
  static constexpr int kSdpM = kBlockM / Config::kSdpWarpsM;              // S, dP: queries
  static constexpr int kSdpN = kBlockN / (kNWarps / Config::kSdpWarpsM);  //        keys
  static constexpr int kKvN = kBlockN / Config::kKvWarpsN;                // dK, dV: keys
  static constexpr int kKvD = kHeadDim / (kNWarps / Config::kKvWarpsN);   //         dims
  static constexpr int kDqM = kBlockM / Config::kDqWarpsM;                // dQ: queries
  static constexpr int kDqD = kHeadDim / (kNWarps / Config::kDqWarpsM);   //     dims
  static constexpr int kPitch = CopyRows<kHeadDim>::kPitch;               // Q, K, V, dO
  static constexpr int kPsPitch = PaddedRows<kBlockN>::kPitch;
  // dQ: each warp computes its (kDqM, kDqD) tile in kDqChunks column chunks (fewer live
  // registers) and adds it to the float32 accumulator kDqVec values per lane and instruction.
  static constexpr int kDqChunks = Config::kDqChunks;
  static constexpr int kDqChunkD = kDqD / kDqChunks;
  static constexpr int kDqVec = Config::kDqVec;
  static constexpr bool kGemmPrefetch = Config::kGemmPrefetch;  // see warp_gemm
  static_assert(kStagesQ >= 1 && kStagesQ <= 2 && kStagesDo >= 1 && kStagesDo <= 2,
                "Q and dO are single- or double-buffered");
  static_assert(kSdpM % 16 == 0 && kSdpN % 16 == 0 && kKvN % 16 == 0 && kKvD % 16 == 0 &&
                    kDqM % 16 == 0 && kDqD % 16 == 0,
                "every warp layout must give whole 16 x 16 warp tiles");
  static_assert(kDqChunkD % 16 == 0, "dQ column chunks are whole n16 steps");
  static_assert(kDqVec == 1 || kDqVec == 4, "dQ reductions are scalar or 16-byte vectors");
  static_assert(kDqAccumRowAlign % kBlockM == 0, "dQ accumulator tiles must not straddle rows");

  struct SharedStorage {
    Element k[kBlockN * kPitch];                // (kBlockN, kHeadDim) CopyRows
    Element v[kBlockN * kPitch];                // (kBlockN, kHeadDim) CopyRows
    Element q[kStagesQ][kBlockM * kPitch];      // (kBlockM, kHeadDim) CopyRows, per stage
    Element dout[kStagesDo][kBlockM * kPitch];  // (kBlockM, kHeadDim) CopyRows, per stage
    Element p[kBlockM * kPsPitch];              // P  (kBlockM, kBlockN) padded
    Element ds[kBlockM * kPsPitch];             // dS (kBlockM, kBlockN) padded
    // Per query tile, double-buffered by tile parity whatever the Q / dO stages.
    float lse[2][kBlockM];       // as the forward wrote it; 0 for rows past the used length
    float dot_do_o[2][kBlockM];  // rowsum(dO * O)
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= Config::kMaxSmemBytes, "the tile config must fit its archs' blocks");

  struct Tile {  // where this block's operands live
    const Element *gq, *gdo, *gk, *gv;
    const float *lse, *dot;
    float* gdq;  // the sequence's first dQ accumulator tile
    int n0;
  };

  // The float32 dQ accumulator holds each query tile's kBlockM x kHeadDim partial sums in the
  // order the dQ GEMM produces them, so that every reduction covers contiguous memory: warp
  // tiles (kDqM x kDqD each) in warp order, in each its m16n8 fragments (mt-major), in each
  // 32 lanes x 4 values.  kDqVec 4: lane-major, one 16-byte reduction per lane, 512 contiguous
  // bytes per warp instruction (red.v4, sm90).  kDqVec 1: value-major, four scalar atomics of
  // 128 contiguous bytes each.  (Row-major order made each reduction of a warp touch eight rows,
  // eight 128-byte lines: 13-15% of the backward's time, benchmarks/NOTES.md entry 11.)
  // Element e of lane `lane` in fragment (mt, dt) of warp `warp` is dQ row
  // wm + mt * 16 + lane / 4 + (e / 2) * 8, column wd + dt * 8 + (lane % 4) * 2 + e % 2.
  static __device__ __forceinline__ int dq_offset(int warp, int mt, int dt, int lane, int e) {
    const int frag = (warp * (kDqM / 16) + mt) * (kDqD / 8) + dt;
    return frag * 128 + (kDqVec == 4 ? lane * 4 + e : e * 32 + lane);
  }
  // Sequence `sq`'s first accumulator tile (the rows tile_config.h's kDqAccumRowAlign describes).
  static __device__ __forceinline__ float* dq_accum_tiles(const BwdParams& p, const SeqlenInfo& sq,
                                                          int head, int batch) {
    const int64_t row0 = p.fwd.seq_q.cu_seqlens == nullptr
                             ? 0
                             : (int64_t(sq.offset) + int64_t(batch) * kBlockM) / kBlockM * kBlockM;
    return static_cast<float*>(p.dq_accum.ptr) + batch * p.dq_accum.batch_stride +
           head * p.dq_accum.head_stride + row0 * p.dq_accum.row_stride;
  }

  // Starts the copies of query tile m's Q rows (and lse) into Q stage `stage`, or of its dO
  // rows (and rowsum(dO*O)); the caller commits.  Rows past the used length are zero-filled.
  static __device__ __forceinline__ void load_q(const BwdParams& p, SharedStorage& smem,
                                                const Tile& t, int len_q, int m, int stage) {
    const int m0 = m * kBlockM;
    load_tile_async<kBlockM, kHeadDim, kThreads>(smem.q[stage],
                                                 t.gq + int64_t(m0) * p.fwd.q.row_stride,
                                                 p.fwd.q.row_stride, len_q - m0, p.fwd.head_dim);
    const int i = threadIdx.x;
    if (i < kBlockM)
      cp_async_4(&smem.lse[m % 2][i], t.lse + (m0 + i < len_q ? m0 + i : 0), m0 + i < len_q);
  }
  static __device__ __forceinline__ void load_do(const BwdParams& p, SharedStorage& smem,
                                                 const Tile& t, int len_q, int m, int stage) {
    const int m0 = m * kBlockM;
    load_tile_async<kBlockM, kHeadDim, kThreads>(smem.dout[stage],
                                                 t.gdo + int64_t(m0) * p.dout.row_stride,
                                                 p.dout.row_stride, len_q - m0, p.fwd.head_dim);
    const int i = threadIdx.x;
    if (i < kBlockM)
      cp_async_4(&smem.dot_do_o[m % 2][i], t.dot + (m0 + i < len_q ? m0 + i : 0), m0 + i < len_q);
  }

  // Writes one warp's m16n8 accumulator tiles to a padded (rows, kBlockN) smem tile as 16 bits.
  static __device__ __forceinline__ void store_tile(Element* dst,
                                                    const float (&x)[kSdpM / 16][kSdpN / 8][4],
                                                    int lane) {
#pragma unroll
    for (int mt = 0; mt < kSdpM / 16; ++mt)
#pragma unroll
      for (int nt = 0; nt < kSdpN / 8; ++nt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          *reinterpret_cast<uint32_t*>(dst + (mt * 16 + lane / 4 + r * 8) * kPsPitch + nt * 8 +
                                       (lane % 4) * 2) =
              pack2<Element>(x[mt][nt][2 * r], x[mt][nt][2 * r + 1]);
        }
  }

  static __device__ void scores(const BwdParams& p, SharedStorage& smem, const MaskInfo& mask,
                                int m, int n0, int q_stage, int do_stage);
  static __device__ void add_dq(SharedStorage& smem, const Tile& t, int m);
  static __device__ void run(const BwdParams& p, SharedStorage& smem);

  // The second kernel: dQ (q's dtype and layout) from the accumulator, one block of kThreads
  // per query tile; rows past the used queries get zeros.
  struct ConvertStorage {
    alignas(16) Element dq[kBlockM * PaddedRows<kHeadDim>::kPitch];
  };
  static __device__ void convert_dq(const BwdParams& p, ConvertStorage& smem);
};

// P = exp(S * scale - lse) and dS = scale * P * (dP - rowsum(dO*O)) for query tile m, stored to
// smem.  Scaling dS here serves both dQ and dK and saves a multiply per dQ element.
template <class ElementTag, int kHeadDim, class Config>
__device__ void BwdKernel<ElementTag, kHeadDim, Config>::scores(const BwdParams& p,
                                                                SharedStorage& smem,
                                                                const MaskInfo& mask, int m, int n0,
                                                                int q_stage, int do_stage) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wm = (warp % Config::kSdpWarpsM) * kSdpM;  // warp tile origin in the block tile
  const int wn = (warp / Config::kSdpWarpsM) * kSdpN;
  const int m0 = m * kBlockM;
  const float scale = p.fwd.softmax_scale;
  const float scale_log2 = scale * float(M_LOG2E);

  float s[kSdpM / 16][kSdpN / 8][4];  // S, then P
  zero(s);
  warp_gemm<kSdpM, kSdpN, kHeadDim, OperandLayout<false, false, true, true>, kGemmPrefetch>(
      s, smem.q[q_stage] + wm * kPitch, kPitch, smem.k + wn * kPitch, kPitch, lane);
  if (!mask.tile_all_visible(m0, kBlockM, n0, kBlockN)) apply_mask(s, mask, m0 + wm, n0 + wn, lane);
#pragma unroll
  for (int mt = 0; mt < kSdpM / 16; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float lse = smem.lse[m % 2][wm + mt * 16 + lane / 4 + r * 8];
      // A row that sees no key has lse -inf and every score masked: 0 keeps exp2(-inf) = 0.
      const float lse_log2 = lse == -INFINITY ? 0.f : lse * float(M_LOG2E);
#pragma unroll
      for (int nt = 0; nt < kSdpN / 8; ++nt) {
        s[mt][nt][2 * r] = fast_exp2(s[mt][nt][2 * r] * scale_log2 - lse_log2);
        s[mt][nt][2 * r + 1] = fast_exp2(s[mt][nt][2 * r + 1] * scale_log2 - lse_log2);
      }
    }
  store_tile(smem.p + wm * kPsPitch + wn, s, lane);

  float dp[kSdpM / 16][kSdpN / 8][4];  // dP, then dS
  zero(dp);
  warp_gemm<kSdpM, kSdpN, kHeadDim, OperandLayout<false, false, true, true>, kGemmPrefetch>(
      dp, smem.dout[do_stage] + wm * kPitch, kPitch, smem.v + wn * kPitch, kPitch, lane);
#pragma unroll
  for (int mt = 0; mt < kSdpM / 16; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float dot_scaled = smem.dot_do_o[m % 2][wm + mt * 16 + lane / 4 + r * 8] * scale;
#pragma unroll
      for (int nt = 0; nt < kSdpN / 8; ++nt) {
        dp[mt][nt][2 * r] = s[mt][nt][2 * r] * fmaf(dp[mt][nt][2 * r], scale, -dot_scaled);
        dp[mt][nt][2 * r + 1] =
            s[mt][nt][2 * r + 1] * fmaf(dp[mt][nt][2 * r + 1], scale, -dot_scaled);
      }
    }
  store_tile(smem.ds + wm * kPsPitch + wn, dp, lane);
}

// dQ[tile m] += dS K (dS carries the softmax scale), added to the float32 accumulator in its
// fragment order (dq_offset).  Every position of the tile exists there, so no element needs a
// bounds test: rows past the used queries and columns past the head dim hold partial sums the
// conversion never writes out.
template <class ElementTag, int kHeadDim, class Config>
__device__ void BwdKernel<ElementTag, kHeadDim, Config>::add_dq(SharedStorage& smem, const Tile& t,
                                                                int m) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wm = (warp % Config::kDqWarpsM) * kDqM;
  const int wd = (warp / Config::kDqWarpsM) * kDqD;
  float* tile = t.gdq + int64_t(m) * kBlockM * kHeadDim;
#pragma unroll
  for (int c = 0; c < kDqChunks; ++c) {
    float dq[kDqM / 16][kDqChunkD / 8][4];
    zero(dq);
    warp_gemm<kDqM, kDqChunkD, kBlockN, OperandLayout<false, true, false, true>, kGemmPrefetch>(
        dq, smem.ds + wm * kPsPitch, kPsPitch, smem.k + wd + c * kDqChunkD, kPitch, lane);
#pragma unroll
    for (int mt = 0; mt < kDqM / 16; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDqChunkD / 8; ++dt) {
        float* dst = tile + dq_offset(warp, mt, c * (kDqChunkD / 8) + dt, lane, 0);
        if constexpr (kDqVec == 4) {
          red_add_f32x4(dst,
                        make_float4(dq[mt][dt][0], dq[mt][dt][1], dq[mt][dt][2], dq[mt][dt][3]));
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) red_add_f32(dst + e * 32, dq[mt][dt][e]);
        }
      }
  }
}

template <class ElementTag, int kHeadDim, class Config>
__device__ void BwdKernel<ElementTag, kHeadDim, Config>::run(const BwdParams& p,
                                                             SharedStorage& smem) {
  const FwdParams& f = p.fwd;
  Tile t;
  // Rank 0 is the first key tile: with a causal mask the most query rows see it (with a window
  // bounded only on the left, the fewest).
  const BlockTile tile = block_tile(f.block_shift);
  const int head = tile.head;
  const int batch = tile.batch;
  t.n0 = tile.rank * kBlockN;
  const int head_kv = head / (f.heads_q / f.heads_kv);
  const SeqlenInfo sq(f.seq_q, batch);
  const SeqlenInfo sk(f.seq_k, batch);
  if (t.n0 >= sk.extent) return;
  const MaskInfo mask(sq.len, sk.len, f.window_left, f.window_right);
  int m_begin, m_end;
  mask.query_block_range(t.n0, kBlockN, kBlockM, m_begin, m_end);

  const int64_t q_row0 = sq.offset, k_row0 = int64_t(sk.offset) + t.n0;
  t.gq = static_cast<const Element*>(f.q.ptr) + batch * f.q.batch_stride + q_row0 * f.q.row_stride +
         head * f.q.head_stride;
  t.gdo = static_cast<const Element*>(p.dout.ptr) + batch * p.dout.batch_stride +
          q_row0 * p.dout.row_stride + head * p.dout.head_stride;
  t.gk = static_cast<const Element*>(f.k.ptr) + batch * f.k.batch_stride + k_row0 * f.k.row_stride +
         head_kv * f.k.head_stride;
  t.gv = static_cast<const Element*>(f.v.ptr) + batch * f.v.batch_stride + k_row0 * f.v.row_stride +
         head_kv * f.v.head_stride;
  t.lse = f.lse.ptr + batch * f.lse.batch_stride + head * f.lse.head_stride + sq.offset;
  t.dot =
      p.dot_do_o.ptr + batch * p.dot_do_o.batch_stride + head * p.dot_do_o.head_stride + sq.offset;
  t.gdq = dq_accum_tiles(p, sq, head, batch);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int kv_n = (warp % Config::kKvWarpsN) * kKvN;  // this warp's dK / dV tile
  const int kv_d = (warp / Config::kKvWarpsN) * kKvD;
  float dk[kKvN / 16][kKvD / 8][4], dv[kKvN / 16][kKvD / 8][4];
  zero(dk);
  zero(dv);

  if (m_begin < m_end) {
    load_tile_async<kBlockN, kHeadDim, kThreads>(smem.k, t.gk, f.k.row_stride, sk.len - t.n0,
                                                 f.head_dim);
    load_tile_async<kBlockN, kHeadDim, kThreads>(smem.v, t.gv, f.v.row_stride, sk.len - t.n0,
                                                 f.head_dim);
    load_q(p, smem, t, sq.len, m_begin, 0);
    load_do(p, smem, t, sq.len, m_begin, 0);
    cp_async_commit();
    for (int m = m_begin; m < m_end; ++m) {
      const int q_stage = kStagesQ == 1 ? 0 : (m - m_begin) % 2;
      const int do_stage = kStagesDo == 1 ? 0 : (m - m_begin) % 2;
      const bool has_next = m + 1 < m_end;
      // Tile m (and its statistics) landed, and every warp is done with tile m-1: its Q / dO
      // stage, its statistics slot and the P / dS tiles may be overwritten.
      cp_async_wait<0>();
      __syncthreads();
      if (has_next && (kStagesQ == 2 || kStagesDo == 2)) {
        if (kStagesQ == 2) load_q(p, smem, t, sq.len, m + 1, q_stage ^ 1);
        if (kStagesDo == 2) load_do(p, smem, t, sq.len, m + 1, do_stage ^ 1);
        cp_async_commit();
      }
      scores(p, smem, mask, m, t.n0, q_stage, do_stage);
      __syncthreads();  // P and dS complete: the GEMMs below read other warps' tiles

      warp_gemm<kKvN, kKvD, kBlockM, OperandLayout<true, true, false, true>, kGemmPrefetch>(
          dv, smem.p + kv_n, kPsPitch, smem.dout[do_stage] + kv_d, kPitch, lane);
      if (kStagesDo == 1 && has_next) {
        __syncthreads();  // every warp is done reading dO: the next tile's may land there
        load_do(p, smem, t, sq.len, m + 1, 0);
        cp_async_commit();
      }
      warp_gemm<kKvN, kKvD, kBlockM, OperandLayout<true, true, false, true>, kGemmPrefetch>(
          dk, smem.ds + kv_n, kPsPitch, smem.q[q_stage] + kv_d, kPitch, lane);
      if (kStagesQ == 1 && has_next) {
        __syncthreads();  // every warp is done reading Q: the next tile's may land there
        load_q(p, smem, t, sq.len, m + 1, 0);
        cp_async_commit();
      }
      add_dq(smem, t, m);
    }
  }

  // dK and dV (dS carries the scale, so dK is scaled) leave through K's and V's shared tiles,
  // so that every global store is a whole 16-byte chunk: straight from the accumulators each
  // warp store touched eight rows, eight 128-byte lines.  Rows past the used keys hold zeros
  // and are written too.
  __syncthreads();  // every warp is done reading K and V
  using Rows = CopyRows<kHeadDim>;
#pragma unroll
  for (int mt = 0; mt < kKvN / 16; ++mt)
#pragma unroll
    for (int dt = 0; dt < kKvD / 8; ++dt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int off =
            Rows::offset(kv_n + mt * 16 + lane / 4 + r * 8, kv_d + dt * 8 + (lane % 4) * 2);
        *reinterpret_cast<uint32_t*>(smem.k + off) =
            pack2<Element>(dk[mt][dt][2 * r], dk[mt][dt][2 * r + 1]);
        *reinterpret_cast<uint32_t*>(smem.v + off) =
            pack2<Element>(dv[mt][dt][2 * r], dv[mt][dt][2 * r + 1]);
      }
  __syncthreads();  // the copy-out reads rows other warps wrote
  Element* gdk = static_cast<Element*>(p.dk.ptr) + batch * p.dk.batch_stride +
                 k_row0 * p.dk.row_stride + head * p.dk.head_stride;
  Element* gdv = static_cast<Element*>(p.dv.ptr) + batch * p.dv.batch_stride +
                 k_row0 * p.dv.row_stride + head * p.dv.head_stride;
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int chunk = threadIdx.x; chunk < kBlockN * kChunksPerRow; chunk += kThreads) {
    const int row = chunk / kChunksPerRow;
    const int col = (chunk % kChunksPerRow) * 8;
    if (t.n0 + row < sk.extent && col < f.head_dim) {
      const int off = Rows::offset(row, col);
      *reinterpret_cast<uint4*>(gdk + int64_t(row) * p.dk.row_stride + col) =
          *reinterpret_cast<const uint4*>(smem.k + off);
      *reinterpret_cast<uint4*>(gdv + int64_t(row) * p.dv.row_stride + col) =
          *reinterpret_cast<const uint4*>(smem.v + off);
    }
  }
}

template <class ElementTag, int kHeadDim, class Config>
__device__ void BwdKernel<ElementTag, kHeadDim, Config>::convert_dq(const BwdParams& p,
                                                                    ConvertStorage& smem) {
  using Rows = PaddedRows<kHeadDim>;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const SeqlenInfo sq(p.fwd.seq_q, batch);
  const int m0 = blockIdx.x * kBlockM;
  if (m0 >= sq.extent) return;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int wm = (warp % Config::kDqWarpsM) * kDqM;
  const int wd = (warp / Config::kDqWarpsM) * kDqD;
  const float* tile = dq_accum_tiles(p, sq, head, batch) + int64_t(m0) * kHeadDim;
#pragma unroll
  for (int mt = 0; mt < kDqM / 16; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDqD / 8; ++dt) {
      const float* src = tile + dq_offset(warp, mt, dt, lane, 0);
      float x[4];
      if constexpr (kDqVec == 4) {
        const float4 v = *reinterpret_cast<const float4*>(src);
        x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) x[e] = src[e * 32];
      }
      const int row = wm + mt * 16 + lane / 4, col = wd + dt * 8 + (lane % 4) * 2;
      *reinterpret_cast<uint32_t*>(smem.dq + Rows::offset(row, col)) = pack2<Element>(x[0], x[1]);
      *reinterpret_cast<uint32_t*>(smem.dq + Rows::offset(row + 8, col)) =
          pack2<Element>(x[2], x[3]);
    }
  __syncthreads();  // the copy-out reads rows other warps converted
  Element* gdq = static_cast<Element*>(p.dq.ptr) + batch * p.dq.batch_stride +
                 int64_t(sq.offset + m0) * p.dq.row_stride + head * p.dq.head_stride;
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int chunk = threadIdx.x; chunk < kBlockM * kChunksPerRow; chunk += kThreads) {
    const int row = chunk / kChunksPerRow;
    const int col = (chunk % kChunksPerRow) * 8;
    if (m0 + row < sq.extent && col < p.fwd.head_dim) {
      const uint4 v = m0 + row < sq.len
                          ? *reinterpret_cast<const uint4*>(smem.dq + Rows::offset(row, col))
                          : make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(gdq + int64_t(row) * p.dq.row_stride + col) = v;
    }
  }
}

template <class Kernel> __global__ void __launch_bounds__(Kernel::kThreads)
    bwd_kernel(const __grid_constant__ BwdParams params) {
#if defined(__CUDA_ARCH__)
  if constexpr (compiled_here<typename Kernel::Config>()) {
    extern __shared__ __align__(16) char smem_buf[];
    Kernel::run(params, *reinterpret_cast<typename Kernel::SharedStorage*>(smem_buf));
  } else {
    __trap();
  }
#endif
}

template <class Kernel> __global__ void __launch_bounds__(Kernel::kThreads)
    bwd_convert_dq_kernel(const __grid_constant__ BwdParams params) {
#if defined(__CUDA_ARCH__)
  if constexpr (compiled_here<typename Kernel::Config>()) {
    __shared__ typename Kernel::ConvertStorage smem;
    Kernel::convert_dq(params, smem);
  } else {
    __trap();
  }
#endif
}

}  // namespace flash_cuda::sm80
