// Portable attention forward: one block per (query tile, head, batch element), walking the key
// tiles its rows can see with an online softmax; Q.K^T and P.V on mma.sync, loads on cp.async.
// Masking, sequence geometry and tile shapes come from the shared components.
#pragma once

#include <cuda.h>

#include <cmath>
#include <type_traits>

#include "common/params.h"
#include "common/ptx.cuh"
#include "common/row_reduce.cuh"
#include "common/seqlen_info.cuh"
#include "common/tile_order.cuh"
#include "sm80/smem_tile.cuh"
#include "sm80/tile_config.h"
#include "sm80/warp_gemm.cuh"

namespace flash_cuda::sm80 {

// kKvcache: attention over a KV cache (Note [KV-cache forward]); otherwise over dense or packed
// K and V, as the fwd op.
template <class ElementTag, int kHeadDim_, class Config_, bool kKvcache_ = false> struct FwdKernel {
  using Element = typename DeviceType<ElementTag>::type;
  using Tag = ElementTag;
  using Config = Config_;
  static constexpr bool kKvcache = kKvcache_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNWarps = Config::kNWarps;
  static constexpr int kThreads = kNWarps * 32;
  // The warps form a kWarpsM x kWarpsN grid: warp (wm, wn) owns rows [wm * kWarpRows, +kWarpRows)
  // and, of them, the keys [wn * kWarpKeys, +kWarpKeys) of S and the head dims [wn * kWarpDims,
  // +kWarpDims) of O.  With kWarpsN = 2 the two warps of a row range trade their row maxima,
  // row sums and P halves through shared memory (RowExchange).
  static constexpr int kWarpsN = Config::kWarpsN;
  static constexpr int kWarpsM = kNWarps / kWarpsN;
  static constexpr int kWarpRows = kBlockM / kWarpsM;
  static constexpr int kWarpKeys = kBlockN / kWarpsN;
  static constexpr int kWarpDims = kHeadDim / kWarpsN;
  static constexpr int kMTiles = kWarpRows / 16;   // m16 MMA tiles per warp
  static constexpr int kNTiles = kWarpKeys / 8;    // n8 tiles of S per warp
  static constexpr int kDTiles = kWarpDims / 8;    // n8 tiles of O per warp
  static constexpr int kPvSteps = kWarpKeys / 16;  // k16 steps of P.V per key range
  // The epilogue's copy of O to global memory: one bulk copy per row (sm90+ code only).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static constexpr bool kBulkStore = Config::kBulkStoreO;
#else
  static constexpr bool kBulkStore = false;
#endif
  using Rows = std::conditional_t<Config::kCopyRows, CopyRows<kHeadDim>, PaddedRows<kHeadDim>>;
  using PRows = PaddedRows<kBlockN>;
  static constexpr int kPitch = Rows::kPitch;
  // Key tiles of K and V in shared memory: 1, the loop of run(), or a ring of kKvStages tiles
  // (KV-cache kernels only; Note [Staged key tiles]).
  static constexpr int kKvStages = Config::kKvStages;
  static_assert(kKvStages == 1 || (kKvcache_ && kWarpsN == 1),
                "staged key tiles are a KV-cache loop of one-warp row ranges");
  static_assert(kWarpsN == 1 || kWarpsN == 2, "a row range is split between at most two warps");
  static_assert(kNWarps % kWarpsN == 0 && kBlockM % kWarpsM == 0, "whole warp grid");
  static_assert(kWarpRows % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(kWarpDims % 16 == 0 && kWarpKeys % 16 == 0, "MMA k-steps are 16 wide");

  // What the two warps of a row range trade (kWarpsN = 2): P in (kBlockM, kBlockN) PRows, each
  // warp writing its own keys' columns; per row, each warp's maximum of the scores of its keys
  // and, at the end, each warp's row sum.  Empty for kWarpsN = 1.
  template <int kSplit, int = 0> struct RowExchange {
    Element p[kBlockM * PRows::kPitch];  // (kBlockM, kBlockN) PRows
    float max[kSplit][kBlockM];
    float sum[kSplit][kBlockM];
  };
  template <int kUnused> struct RowExchange<1, kUnused> {};
  // O is staged through q's buffer in the epilogue (each warp rewrites only its own rows and
  // columns, after a barrier that every Q.K^T precedes).
  struct PlainStorage : RowExchange<kWarpsN> {
    alignas(16) Element q[kBlockM * kPitch];  // (kBlockM, kHeadDim) Rows
    Element k[kKvStages * kBlockN * kPitch];  // kKvStages x (kBlockN, kHeadDim) Rows
    Element v[kKvStages * kBlockN * kPitch];  // kKvStages x (kBlockN, kHeadDim) Rows
  };
  // Key tiles by TMA (Config::kTmaKeys; Note [TMA key tiles]): each stage of K and of V is
  // kHeadDim / 64 blocks of (kBlockN, 64) in the 128-byte swizzle, each block 1024-byte aligned
  // as the swizzle needs; one mbarrier a stage.
  static constexpr bool kTmaKeys = Config::kTmaKeys;
  struct TmaStorage {
    alignas(1024) Element k[kKvStages * kBlockN * kHeadDim];
    alignas(1024) Element v[kKvStages * kBlockN * kHeadDim];
    alignas(16) Element q[kBlockM * kPitch];  // (kBlockM, kHeadDim) Rows
    uint64_t full[kKvStages];
  };
  using SharedStorage = std::conditional_t<kTmaKeys, TmaStorage, PlainStorage>;
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= Config::kMaxSmemBytes, "the tile config must fit its archs' blocks");
  // The README promises the forward on sm86/sm89 for every head dim but 161-192.
  static_assert(kHeadDim == 192 || kSmemBytes <= kMaxSmemBytesSm86 || Config::kHasSmallTile,
                "the tile config must fit the 99 KB of an sm86/sm89/sm120 block, or name a "
                "config that does");

  // Note [Stale row maximum]
  // The online softmax keeps, per row, the maximum m that its exponentials are taken against
  // and rescales O and the row sum whenever m changes.  O / sum and lse = m * scale + log(sum)
  // hold for any m under which exp2((s - m) * scale_log2) does not overflow, so m is raised only
  // when a row's maximum grows by more than kMaxGrowthLog2 (in log2 units) over it.  P is then
  // at most 2^kMaxGrowthLog2 = 256, well inside fp16 and bf16, and O and sum in fp32 grow by at
  // most that factor.  The cost is in rounding: with the exact maximum the largest P is 1.0,
  // which the 16-bit P of the P.V product holds exactly; a stale one rounds it like every other
  // P (relative 2^-9 in bf16), while the fp32 sum keeps it unrounded.  Emulated, the output's
  // error against an fp32 reference grew by 6% on average (18% at the worst element) for
  // normal inputs and by about 20% (35-60%) for rows dominated by a few keys, well inside the
  // tests' rule (NOTES entry 39).  After the first key tile a row's maximum seldom grows that
  // much, so the
  // warp skips the rescale of O on nearly every tile, also at short sequences, where an exact
  // maximum changes on most tiles (NOTES entry 39).  Applied where two warps share a row range
  // (kWarpsN = 2); the one-warp step, which finds its maxima in line, spilled with it (hdims 64
  // and 128).
  static constexpr float kMaxGrowthLog2 = 8.f;

  // Per-thread state of the online softmax for its 2 * kMTiles rows.
  struct RowState {
    float max[kMTiles][2];
    float sum[kMTiles][2];  // partial over this thread's columns; reduced in the epilogue
  };

  // s[mt][nt] += Q[warp rows] . K^T for one key tile (fp32 accumulators, m16n8 layout).  The
  // fragments of k-step ks + 1 are loaded before the MMAs of step ks, so that no MMA waits for
  // the ldmatrix that feeds it.
  // kSwizzledKeys: K in TMA's 128-byte swizzle (TmaStorage): chunk c of key row r at
  // c ^ (r mod 8) in its 64-column block; r mod 8 is lane mod 8 here, so the lane's XOR term
  // is fixed and each k-step adds its own constant.
  template <bool kSwizzledKeys = false>
  static __device__ __forceinline__ void gemm_qk(float (&s)[kMTiles][kNTiles][4], const Element* sq,
                                                 const Element* sk, int warp_row0, int lane) {
    const int swap = Rows::lane_chunk_swap(lane);  // every row here is lane mod 8
    const int key_xor = ((lane / 8) % 2) ^ (lane % 8);  // kSwizzledKeys only
    uint32_t a[2][kMTiles][4], b[2][kNTiles / 2][4];
    auto load = [&](int ks, int slot) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        ldmatrix_x4(a[slot][mt], sq + (warp_row0 + mt * 16 + lane % 16) * kPitch + ks * 16 +
                                     ((lane / 16) ^ swap) * 8);
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        // Matrices: keys 0-7 | k 0-7, keys 0-7 | k 8-15, keys 8-15 | k 0-7, keys 8-15 | k 8-15.
        if constexpr (kSwizzledKeys) {
          ldmatrix_x4(b[slot][np], sk + (ks / 4) * (kBlockN * 64) +
                                       (np * 16 + (lane / 16) * 8 + lane % 8) * 64 +
                                       (((ks % 4) * 2) ^ key_xor) * 8);
        } else {
          ldmatrix_x4(b[slot][np], sk + (np * 16 + (lane / 16) * 8 + lane % 8) * kPitch +
                                       ks * 16 + (((lane / 8) % 2) ^ swap) * 8);
        }
      }
    };
    load(0, 0);
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      if (ks + 1 < kHeadDim / 16) load(ks + 1, (ks + 1) % 2);
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np)
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<Element>(s[mt][2 * np], a[ks % 2][mt], b[ks % 2][np][0], b[ks % 2][np][1]);
          mma_16816<Element>(s[mt][2 * np + 1], a[ks % 2][mt], b[ks % 2][np][2], b[ks % 2][np][3]);
        }
    }
  }

  // o[mt][dt] += P . V over one warp's key range: P arrives packed to 16 bits in the A-operand
  // layout (see pack_p); sv points at V's row of the range's first key and the warp's first dim.
  // kSwizzledKeys: V as gemm_qk's K (TmaStorage).
  template <bool kSwizzledKeys = false>
  static __device__ __forceinline__ void gemm_pv(float (&o)[kMTiles][kDTiles][4],
                                                 const uint32_t (&p)[kMTiles][kPvSteps][4],
                                                 const Element* sv, int lane) {
    const int swap = Rows::lane_chunk_swap(lane);  // every row here is lane mod 8
    const int key_xor = (lane / 16) ^ (lane % 8);   // kSwizzledKeys only
#pragma unroll
    for (int kk = 0; kk < kPvSteps; ++kk) {
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        // V is (key, dim) in smem; .trans hands each thread the key pair the B operand needs.
        uint32_t b[4];
        if constexpr (kSwizzledKeys) {
          ldmatrix_x4_trans(b, sv + (dp / 4) * (kBlockN * 64) +
                                   (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * 64 +
                                   (((dp % 4) * 2) ^ key_xor) * 8);
        } else {
          ldmatrix_x4_trans(b, sv + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kPitch +
                                   dp * 16 + ((lane / 16) ^ swap) * 8);
        }
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          mma_16816<Element>(o[mt][2 * dp], p[mt][kk], b[0], b[1]);
          mma_16816<Element>(o[mt][2 * dp + 1], p[mt][kk], b[2], b[3]);
        }
      }
    }
  }

  // The m16n8 accumulator layout of two adjacent n8 tiles is exactly the m16k16 A-operand
  // layout, so P goes from the S accumulators to the PV MMA without leaving registers; packing
  // right after the softmax frees the fp32 copy early (it is what keeps kBlockN = 64 unspilled).
  static __device__ __forceinline__ void pack_p(uint32_t (&p)[kMTiles][kPvSteps][4],
                                                const float (&s)[kMTiles][kNTiles][4]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
        p[mt][kk][0] = pack2<Element>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        p[mt][kk][1] = pack2<Element>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        p[mt][kk][2] = pack2<Element>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        p[mt][kk][3] = pack2<Element>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
  }

  // Each row's maximum over the running max and this warp's keys of s (the four threads of a
  // quad hold the same row).
  static __device__ __forceinline__ void row_max(const float (&s)[kMTiles][kNTiles][4],
                                                 const RowState& st, float (&mx)[kMTiles][2]) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[mt][r] = st.max[mt][r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          mx[mt][r] = fmaxf(mx[mt][r], fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        }
        mx[mt][r] = quad_max(mx[mt][r]);
      }
  }

  // Online softmax step: new running max, rescale of the old sum and O, S -> P in place.
  // Rescaling O costs kDTiles * 4 multiplies per row; when no row of the warp raises its
  // maximum (Note [Stale row maximum]) the warp skips the rescale.
  // With kWarpsN = 1 the step finds the row maxima itself, one row at a time between that row's
  // exponentials (all rows' maxima and shuffles before any exponential, as row_max does, measured
  // 0.3-1.8% slower at hdim 128, NOTES entry 26); otherwise `row_max_all` holds them
  // over all the block's keys (row_max of both warps of the row range).
  static __device__ __forceinline__ void softmax_step(float (&s)[kMTiles][kNTiles][4],
                                                      float (&o)[kMTiles][kDTiles][4], RowState& st,
                                                      float scale_log2,
                                                      const float (&row_max_all)[kMTiles][2]) {
    float correction[kMTiles][2];
    bool any_change = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = st.max[mt][r];
        if constexpr (kWarpsN == 1) {
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          }
          mx = quad_max(mx);  // the four threads of a quad hold the same row
        } else {
          mx = row_max_all[mt][r];
          // Note [Stale row maximum]: a maximum that grew by at most kMaxGrowthLog2 is not
          // taken up.  (Both -inf gives NaN, false: a row with no visible key yet keeps -inf.)
          if (!((mx - st.max[mt][r]) * scale_log2 > kMaxGrowthLog2)) mx = st.max[mt][r];
        }
        // A fully masked row so far keeps max -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        const float mx_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
        if constexpr (kWarpsN > 1) {
          // While a row's maximum is -inf its O is still zero (no key seen), so raising the
          // maximum needs no rescale: the first key tile rescales nothing.
          any_change |= mx != st.max[mt][r] && st.max[mt][r] != -INFINITY;
        } else {
          any_change |= mx != st.max[mt][r];
        }
        correction[mt][r] = fast_exp2(st.max[mt][r] * scale_log2 - mx_scaled);
        st.max[mt][r] = mx;
        float sum = st.sum[mt][r] * correction[mt][r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            s[mt][nt][e] = fast_exp2(s[mt][nt][e] * scale_log2 - mx_scaled);
            sum += s[mt][nt][e];
          }
        }
        st.sum[mt][r] = sum;
      }
    if (__any_sync(0xffffffff, any_change)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          o[mt][dt][0] *= correction[mt][0];
          o[mt][dt][1] *= correction[mt][0];
          o[mt][dt][2] *= correction[mt][1];
          o[mt][dt][3] *= correction[mt][1];
        }
    }
  }

  // The row exchange of kWarpsN = 2.  Rows of a warp's accumulators: warp_row0 + mt * 16 +
  // lane / 4 + r * 8; the quad's first lane speaks for the row.
  static __device__ __forceinline__ void share_rows(float* rows, const float (&v)[kMTiles][2],
                                                    int warp_row0, int lane) {
    if (lane % 4 == 0) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) rows[warp_row0 + mt * 16 + lane / 4 + r * 8] = v[mt][r];
    }
  }
  template <class Op>
  static __device__ __forceinline__ void combine_rows(float (&v)[kMTiles][2], const float* rows,
                                                      int warp_row0, int lane, Op op) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        v[mt][r] = op(v[mt][r], rows[warp_row0 + mt * 16 + lane / 4 + r * 8]);
  }
  // Writes this warp's packed P (its rows, keys from key0) into the (kBlockM, kBlockN) P tile;
  // load_p reads such a range back in the same A-operand layout.
  static __device__ __forceinline__ void store_p(Element* sp,
                                                 const uint32_t (&pk)[kMTiles][kPvSteps][4],
                                                 int warp_row0, int key0, int lane) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
        Element* dst =
            sp + PRows::offset(warp_row0 + mt * 16 + lane / 4, key0 + kk * 16 + (lane % 4) * 2);
        *reinterpret_cast<uint32_t*>(dst) = pk[mt][kk][0];
        *reinterpret_cast<uint32_t*>(dst + 8 * PRows::kPitch) = pk[mt][kk][1];
        *reinterpret_cast<uint32_t*>(dst + 8) = pk[mt][kk][2];
        *reinterpret_cast<uint32_t*>(dst + 8 * PRows::kPitch + 8) = pk[mt][kk][3];
      }
  }
  static __device__ __forceinline__ void load_p(uint32_t (&pk)[kMTiles][kPvSteps][4],
                                                const Element* sp, int warp_row0, int key0,
                                                int lane) {
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int kk = 0; kk < kPvSteps; ++kk) {
        // Matrices: rows 0-7 | 8-15 x keys 0-7, then rows 0-7 | 8-15 x keys 8-15: pack_p's order.
        ldmatrix_x4(pk[mt][kk], sp + PRows::offset(warp_row0 + mt * 16 + lane % 16,
                                                   key0 + kk * 16 + (lane / 16) * 8));
      }
  }
  // The two warps of row range `warp_m` wait for each other (barrier 0 is __syncthreads').
  static __device__ __forceinline__ void pair_barrier(int warp_m) {
    named_barrier_sync(1 + warp_m, kWarpsN * 32);
  }

  // tma_k, tma_v: the caches' tensor maps (kTmaKeys kernels only; __grid_constant__).
  static __device__ void run(const FwdParams& p, SharedStorage& smem,
                             const CUtensorMap* tma_k = nullptr,
                             const CUtensorMap* tma_v = nullptr);
  static __device__ void epilogue(const FwdParams& p, SharedStorage& smem,
                                  float (&o)[kMTiles][kDTiles][4], RowState& st,
                                  const SeqlenInfo& sq, int m0, int head, int batch);
  static __device__ void epilogue_split(const FwdParams& p, SharedStorage& smem,
                                        float (&o)[kMTiles][kDTiles][4], RowState& st,
                                        const SeqlenInfo& sq, int m0, int head, int batch,
                                        int split);
};

// Note [KV-cache forward]
// The kvcache kernels (kKvcache) are this kernel with three differences, each a runtime choice
// inside the one instantiation per (dtype, head dim):
// - keys: sequence b's keys are cache rows [leftpad, cache_seqlens + new rows) (SeqlenInfo's
//   KvCacheArgs constructor), in cache row batch_idx[b] of a dense cache, read as the dense
//   kernel reads K, or in the pages of a paged one, where each thread finds the page of each
//   row it copies (load_rows_async);
// - splits: grid z is batch x num_splits; with num_splits > 1 split s takes the s-th share of
//   the key tiles the block's rows see and writes float32 partials (epilogue_split) for the
//   combine kernel; a split with no key tile writes out 0 and lse -inf;
// - nothing else: the mask is the whole sequence's, and GQA packing (a group's query heads as
//   the rows of one tile) is the launcher's view of q, out and lse.
// A decode step (at most 16 query rows per head, packed) runs FwdDecodeTileConfig's one-warp
// blocks, whose key tiles are staged (Note [Staged key tiles]); longer queries run the
// forward's own tiles through the loop below it.
template <class ElementTag, int kHeadDim, class Config, bool kKvcache_>
__device__ void FwdKernel<ElementTag, kHeadDim, Config, kKvcache_>::run(
    const FwdParams& p, SharedStorage& smem, const CUtensorMap* tma_k, const CUtensorMap* tma_v) {
  if constexpr (kKvcache) {
    // Launched to overlap the append kernels (or whatever the stream ran before): wait for
    // them; then let the combine start its blocks (Note [Overlapped launches]).
    pdl_wait();
    pdl_release();
  }
  // Rank 0 is the last query tile: with a causal mask it sees the most keys (with a window
  // bounded only on the left, the fewest).
  const BlockTile tile = block_tile(p.block_shift);
  const int m_block = int(gridDim.x >> p.block_shift) - 1 - tile.rank;
  const int head = tile.head;
  const int batch = kKvcache ? tile.batch / p.split.num_splits : tile.batch;
  const SeqlenInfo sq(p.seq_q, batch);
  const SeqlenInfo sk = kKvcache ? SeqlenInfo(p.kv, batch) : SeqlenInfo(p.seq_k, batch);
  const int m0 = m_block * kBlockM;
  if (m0 >= sq.extent) return;
  const int head_kv = head / (p.heads_q / p.heads_kv);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_n = warp % kWarpsN;
  const int warp_row0 = warp / kWarpsN * kWarpRows;
  const int key0 = warp_n * kWarpKeys;  // this warp's keys within a key tile
  const int dim0 = warp_n * kWarpDims;  // and its head dims of O
  const MaskInfo mask(sq.len, sk.len, p.window_left, p.window_right);
  int n_begin, n_end;
  mask.key_block_range(m0, kBlockM, kBlockN, n_begin, n_end);
  int split = 0;
  if constexpr (kKvcache) {
    // This split's share of the visible key tiles (Note [KV-cache forward]).
    const int splits = p.split.num_splits;
    split = tile.batch % splits;
    const int share = (max(n_end - n_begin, 0) + splits - 1) / splits;
    n_begin += split * share;
    n_end = min(n_end, n_begin + share);
  }

  // A dense cache's row for this sequence (the dense kernel's: the batch element).
  int kv_batch = batch;
  if constexpr (kKvcache) {
    kv_batch = min(max(p.kv.batch_idx != nullptr ? p.kv.batch_idx[batch] : batch, 0),
                   p.kv.cache_dim0 - 1);
  }
  const Element* gq = static_cast<const Element*>(p.q.ptr) + batch * p.q.batch_stride +
                      int64_t(sq.offset + m0) * p.q.row_stride + head * p.q.head_stride;
  const Element* gk = static_cast<const Element*>(p.k.ptr) + kv_batch * p.k.batch_stride +
                      int64_t(sk.offset) * p.k.row_stride + head_kv * p.k.head_stride;
  const Element* gv = static_cast<const Element*>(p.v.ptr) + kv_batch * p.v.batch_stride +
                      int64_t(sk.offset) * p.v.row_stride + head_kv * p.v.head_stride;
  // The kvcache kernels' load of key tile n0 / kBlockN of K (or V) into shared memory (the
  // dense kernel's calls stay as they were: its code is unchanged).  Paged: row r of the tile
  // is the sequence's row sk.offset + n0 + r, in the page the table names.
  auto load_keys = [&](Element* dst, const Element* g, const TensorRef& t, int n0) {
    if constexpr (kKvcache) {
      if (p.kv.page_table != nullptr) {
        const Element* base = static_cast<const Element*>(t.ptr) + head_kv * t.head_stride;
        const int* pages = p.kv.page_table + int64_t(batch) * p.kv.pages_per_seq;
        const int page_size = p.kv.page_size;
        auto row_ptr = [&](int r) {
          const int row = sk.offset + n0 + r;
          const int page = min(max(pages[row / page_size], 0), p.kv.cache_dim0 - 1);
          return base + int64_t(page) * t.batch_stride + int64_t(row % page_size) * t.row_stride;
        };
        load_rows_async<kBlockN, kHeadDim, kThreads, Rows>(dst, row_ptr, sk.len - n0,
                                                           p.head_dim, base);
        return;
      }
    }
    load_tile_async<kBlockN, kHeadDim, kThreads, Rows>(dst, g + int64_t(n0) * t.row_stride,
                                                       t.row_stride, sk.len - n0, p.head_dim);
  };
  const float scale_log2 = p.softmax_scale * float(M_LOG2E);

  float o[kMTiles][kDTiles][4];
  RowState st;
  zero(o);
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    st.max[mt][0] = st.max[mt][1] = -INFINITY;
    st.sum[mt][0] = st.sum[mt][1] = 0.f;
  }

  // Rows past the used length are zero-filled, not loaded: their scores are masked, but a NaN
  // there (an unwritten KV cache slot, say) would survive the 0 * NaN of the MMAs.
  if constexpr (kKvStages > 1) {
    // Note [Staged key tiles]
    // Step i of the walk (key tiles last to first, as below) reads tile n_end - 1 - i from
    // stage i % kKvStages.  Each step first issues the copy of tile i + kKvStages - 1 into the
    // stage step i - 1 read (every warp is past it: the first barrier), one commit group per
    // tile, empty past the last, so that waiting for all but the newest kKvStages - 1 groups
    // means tile i (and, at step 0, Q) has landed; the second barrier publishes it.  A last
    // barrier ends every lane's reads of Q before the epilogue stages O in its rows.
    const int steps = max(n_end - n_begin, 0);
    if (steps > 0) {
      load_tile_async<kBlockM, kHeadDim, kThreads, Rows>(smem.q, gq, p.q.row_stride,
                                                         sq.len - m0, p.head_dim);
    }
    // Paged keys with kPrefetchPages: each thread copies the same kPageRows rows of every tile
    // (one 16-byte column of each), so it looks their pages up once for K and V, and a step
    // ahead: the table's loads for tile i + kKvStages are issued at step i and used at step
    // i + 1, so no copy waits for the table.
    constexpr int kChunksPerRow = kHeadDim / 8;
    constexpr bool kPrefetch = Config::kPrefetchPages && kThreads % kChunksPerRow == 0 &&
                               (kBlockN * kChunksPerRow) % kThreads == 0;
    constexpr int kRowsPerPass = kPrefetch ? kThreads / kChunksPerRow : 1;
    constexpr int kPageRows = kPrefetch ? kBlockN / kRowsPerPass : 1;
    const bool paged = p.kv.page_table != nullptr;
    // Where every key tile lies inside one page (pages of a multiple of kBlockN rows, and the
    // sequence's keys starting on a tile boundary of its pages), a tile takes one lookup, not
    // one per row; a power-of-2 page size divides by a shift (NOTES entry 77).
    const int page_size = p.kv.page_size;
    const int page_shift = paged && (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
    const bool tile_in_page = paged && page_size % kBlockN == 0 && sk.offset % kBlockN == 0;
    auto page_index = [&](int row) {
      return page_shift >= 0 ? row >> page_shift : row / page_size;
    };
    int page_of[kPageRows], slot_of[kPageRows];  // the next tile to issue: page, row in page
    auto lookup = [&](int i) {
      if constexpr (kPrefetch) {
        const int* pages = p.kv.page_table + int64_t(batch) * p.kv.pages_per_seq;
        const int n0 = (n_end - 1 - i) * kBlockN;
        if (tile_in_page) {
          const int row0 = sk.offset + n0;
          const int index = page_index(row0);
          const int page = i < steps ? pages[index] : 0;
          const int slot0 = row0 - index * page_size;
#pragma unroll
          for (int j = 0; j < kPageRows; ++j) {
            const int r = threadIdx.x / kChunksPerRow + j * kRowsPerPass;
            const bool valid = i < steps && n0 + r < sk.len;
            page_of[j] = page;
            slot_of[j] = valid ? slot0 + r : -1;
          }
        } else {
#pragma unroll
          for (int j = 0; j < kPageRows; ++j) {
            const int r = threadIdx.x / kChunksPerRow + j * kRowsPerPass;
            const int row = sk.offset + n0 + r;
            const bool valid = i < steps && n0 + r < sk.len;
            const int index = page_index(row);
            page_of[j] = valid ? pages[index] : 0;
            slot_of[j] = valid ? row - index * page_size : -1;
          }
        }
      }
    };
    auto issue = [&](int i) {
      if (i < steps) {
        const int n0 = (n_end - 1 - i) * kBlockN;
        const int stage = i % kKvStages;
        Element* dk = smem.k + stage * kBlockN * kPitch;
        Element* dv = smem.v + stage * kBlockN * kPitch;
        if (kPrefetch && paged) {
          const int col = (threadIdx.x % kChunksPerRow) * 8;
          const Element* bk = static_cast<const Element*>(p.k.ptr) + head_kv * p.k.head_stride;
          const Element* bv = static_cast<const Element*>(p.v.ptr) + head_kv * p.v.head_stride;
#pragma unroll
          for (int j = 0; j < kPageRows; ++j) {
            const int r = threadIdx.x / kChunksPerRow + j * kRowsPerPass;
            const bool valid = slot_of[j] >= 0 && col < p.head_dim;
            const int64_t page = min(max(page_of[j], 0), p.kv.cache_dim0 - 1);
            const int64_t slot = max(slot_of[j], 0);
            // One offset for K and V: the op takes caches of the same strides only
            // (ops/kvcache_cuda.cpp).
            const int64_t offset = page * p.k.batch_stride + slot * p.k.row_stride + col;
            const Element* sk_row = bk + offset;
            const Element* sv_row = bv + offset;
            cp_async_16(dk + Rows::offset(r, col), valid ? sk_row : bk, valid);
            cp_async_16(dv + Rows::offset(r, col), valid ? sv_row : bv, valid);
          }
        } else {
          load_keys(dk, gk, p.k, n0);
          load_keys(dv, gv, p.v, n0);
        }
      }
      cp_async_commit();
    };
    if constexpr (kTmaKeys) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // Note [TMA key tiles]
      // In sm90 code of a kTmaKeys config, key tile i of K and of V arrives as kHeadDim / 64
      // TMA boxes of (64 columns, kBlockN rows) each, issued by thread 0 onto stage i %
      // kKvStages's mbarrier, instead of the block's cp.async copies (16 bytes a lane, an
      // address each: most of what a one-warp decode block issues besides its MMAs, NOTES
      // entries 48 and 91).  The tensor maps (launch_fwd_kvcache.cuh) span a dense cache's
      // (d, rows, heads, cache rows) or a paged cache's (d, page rows, heads, pages); a tile
      // lies inside one page (the launcher takes pages of a multiple of kBlockN rows and no
      // leftpad), looked up a step ahead.  Columns past the head dim and rows past the cache
      // arrive as zeros; rows past the sequence's keys inside the cache hold whatever the
      // cache holds (NaN in an unwritten slot): their scores are masked, and the block zeroes
      // them in V, since a masked P of 0 times NaN is NaN.  Q still arrives by cp.async.
      constexpr int kColBlocks = kHeadDim / 64;
      constexpr int kStageElems = kBlockN * kHeadDim;
      constexpr uint32_t kTileBytes = uint32_t(kStageElems * sizeof(Element));
      if (steps > 0) cp_async_commit();  // Q's group
      if (threadIdx.x == 0) {
#pragma unroll
        for (int stage = 0; stage < kKvStages; ++stage) mbarrier_init(&smem.full[stage], 1);
        fence_barrier_init();
      }
      __syncthreads();
      const int* pages = paged ? p.kv.page_table + int64_t(batch) * p.kv.pages_per_seq : nullptr;
      int next_row = 0, next_outer = 0;  // the next tile to issue: its first row, page or row
      auto lookup_tile = [&](int i) {
        if (threadIdx.x != 0 || i >= steps) return;
        const int row = sk.offset + (n_end - 1 - i) * kBlockN;
        if (paged) {
          const int index = page_index(row);
          next_outer = min(max(pages[index], 0), p.kv.cache_dim0 - 1);
          next_row = row - index * page_size;
        } else {
          next_outer = kv_batch;
          next_row = row;
        }
      };
      auto issue_tile = [&](int i) {
        if (threadIdx.x != 0 || i >= steps) return;
        const int stage = i % kKvStages;
        mbarrier_arrive_expect_tx(&smem.full[stage], 2 * kTileBytes);
#pragma unroll
        for (int c = 0; c < kColBlocks; ++c) {
          const int offset = stage * kStageElems + c * kBlockN * 64;
          tma_load_4d(smem.k + offset, tma_k, c * 64, next_row, head_kv, next_outer,
                      &smem.full[stage]);
          tma_load_4d(smem.v + offset, tma_v, c * 64, next_row, head_kv, next_outer,
                      &smem.full[stage]);
        }
      };
#pragma unroll
      for (int i = 0; i < kKvStages - 1; ++i) {
        lookup_tile(i);
        issue_tile(i);
      }
      lookup_tile(kKvStages - 1);
      for (int i = 0; i < steps; ++i) {
        __syncthreads();  // every thread is past step i - 1, whose stage issue_tile refills
        fence_proxy_async_smem();
        issue_tile(i + kKvStages - 1);
        lookup_tile(i + kKvStages);
        if (i == 0) {
          cp_async_wait<0>();  // Q
          __syncthreads();
        }
        const int stage = i % kKvStages;
        mbarrier_wait(&smem.full[stage], uint32_t(i / kKvStages) & 1u);
        const int n0 = (n_end - 1 - i) * kBlockN;
        const int keys = sk.len - n0;
        if (keys < kBlockN) {
          Element* sv = smem.v + stage * kStageElems;
          for (int c = threadIdx.x; c < kColBlocks * kBlockN * 8; c += kThreads) {
            if ((c / 8) % kBlockN >= keys) {
              *reinterpret_cast<uint4*>(sv + c * 8) = make_uint4(0, 0, 0, 0);
            }
          }
          __syncthreads();
        }
        float s[kMTiles][kNTiles][4];
        zero(s);
        gemm_qk<true>(s, smem.q, smem.k + stage * kStageElems, warp_row0, lane);
        if (!mask.tile_all_visible(m0, kBlockM, n0, kBlockN)) {
          apply_mask(s, mask, m0 + warp_row0, n0, lane);
        }
        float unused[kMTiles][2];
        softmax_step(s, o, st, scale_log2, unused);
        uint32_t p_packed[kMTiles][kPvSteps][4];
        pack_p(p_packed, s);
        gemm_pv<true>(o, p_packed, smem.v + stage * kStageElems, lane);
      }
#else
      __trap();  // the launcher runs this config only where the device runs sm90 code
#endif
    } else {
#pragma unroll
      for (int i = 0; i < kKvStages - 1; ++i) {
        if (kPrefetch && paged) lookup(i);
        issue(i);
      }
      if (kPrefetch && paged) lookup(kKvStages - 1);
      for (int i = 0; i < steps; ++i) {
        __syncthreads();
        issue(i + kKvStages - 1);
        if (kPrefetch && paged) lookup(i + kKvStages);
        cp_async_wait<kKvStages - 1>();
        __syncthreads();
        const int n0 = (n_end - 1 - i) * kBlockN;
        const int stage = i % kKvStages;
        float s[kMTiles][kNTiles][4];
        zero(s);
        gemm_qk(s, smem.q, smem.k + stage * kBlockN * kPitch, warp_row0, lane);
        if (!mask.tile_all_visible(m0, kBlockM, n0, kBlockN)) {
          apply_mask(s, mask, m0 + warp_row0, n0, lane);
        }
        float unused[kMTiles][2];
        softmax_step(s, o, st, scale_log2, unused);
        uint32_t p_packed[kMTiles][kPvSteps][4];
        pack_p(p_packed, s);
        gemm_pv(o, p_packed, smem.v + stage * kBlockN * kPitch, lane);
      }
    }
    __syncthreads();
  } else if (n_begin < n_end) {
    load_tile_async<kBlockM, kHeadDim, kThreads, Rows>(smem.q, gq, p.q.row_stride, sq.len - m0,
                                                       p.head_dim);
    // Key tiles run last to first so the first one visited is the partially masked diagonal.
    int n = n_end - 1;
    if constexpr (kKvcache) {
      load_keys(smem.k, gk, p.k, n * kBlockN);
    } else {
      load_tile_async<kBlockN, kHeadDim, kThreads, Rows>(
          smem.k, gk + int64_t(n) * kBlockN * p.k.row_stride, p.k.row_stride,
          sk.len - n * kBlockN, p.head_dim);
    }
    cp_async_commit();
    if constexpr (Config::kPrologueV) {
      // The first V tile too, in its own commit group: the first iteration, which has no
      // earlier P.V to hide a copy behind, then waits for it only after its Q.K^T.
      if constexpr (kKvcache) {
        load_keys(smem.v, gv, p.v, n * kBlockN);
      } else {
        load_tile_async<kBlockN, kHeadDim, kThreads, Rows>(
            smem.v, gv + int64_t(n) * kBlockN * p.v.row_stride, p.v.row_stride,
            sk.len - n * kBlockN, p.head_dim);
      }
      cp_async_commit();
    }
    for (; n >= n_begin; --n) {
      const int n0 = n * kBlockN;
      const bool v_loaded = Config::kPrologueV && n == n_end - 1;
      // K[n] (and Q) landed; every warp is done with V[n+1], so V[n] may overwrite it.
      if (v_loaded) {
        cp_async_wait<1>();  // all but the first V tile
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      if (!v_loaded) {
        if constexpr (kKvcache) {
          load_keys(smem.v, gv, p.v, n0);
        } else {
          load_tile_async<kBlockN, kHeadDim, kThreads, Rows>(
              smem.v, gv + int64_t(n0) * p.v.row_stride, p.v.row_stride, sk.len - n0,
              p.head_dim);
        }
        cp_async_commit();
      }

      float s[kMTiles][kNTiles][4];
      zero(s);
      gemm_qk(s, smem.q, smem.k + key0 * kPitch, warp_row0, lane);
      if (!mask.tile_all_visible(m0, kBlockM, n0, kBlockN)) {
        apply_mask(s, mask, m0 + warp_row0, n0 + key0, lane);
      }
      float mx[kMTiles][2];
      if constexpr (kWarpsN > 1) {
        row_max(s, st, mx);
        share_rows(smem.max[warp_n], mx, warp_row0, lane);
      }
      // V[n] landed; every warp is done reading K[n], so K[n-1] may overwrite it.  Issuing it
      // before the softmax gives the copy the softmax and P.V to land in.  (The barrier also
      // publishes the row maxima just shared: the partner reads them below and overwrites its
      // own only after the next iteration's first barrier.)
      cp_async_wait<0>();
      __syncthreads();
      if (n > n_begin) {
        if constexpr (kKvcache) {
          load_keys(smem.k, gk, p.k, n0 - kBlockN);
        } else {
          load_tile_async<kBlockN, kHeadDim, kThreads, Rows>(
              smem.k, gk + int64_t(n0 - kBlockN) * p.k.row_stride, p.k.row_stride,
              sk.len - (n0 - kBlockN), p.head_dim);
        }
        cp_async_commit();
      }
      if constexpr (kWarpsN > 1)
        combine_rows(mx, smem.max[warp_n ^ 1], warp_row0, lane,
                     [](float a, float b) { return fmaxf(a, b); });
      softmax_step(s, o, st, scale_log2, mx);
      uint32_t p_packed[kMTiles][kPvSteps][4];
      pack_p(p_packed, s);
      if constexpr (kWarpsN == 1) {
        gemm_pv(o, p_packed, smem.v, lane);
      } else {
        // This warp's keys from registers, then the partner's from its P half.  smem.p is
        // rewritten only after the next iteration's second barrier, when both warps are past
        // these reads.
        store_p(smem.p, p_packed, warp_row0, key0, lane);
        gemm_pv(o, p_packed, smem.v + key0 * kPitch + dim0, lane);
        pair_barrier(warp / kWarpsN);  // the partner's P half is written
        const int partner_key0 = (warp_n ^ 1) * kWarpKeys;
        load_p(p_packed, smem.p, warp_row0, partner_key0, lane);
        gemm_pv(o, p_packed, smem.v + partner_key0 * kPitch + dim0, lane);
      }
    }
  }
  if constexpr (kKvcache) {
    if (p.split.num_splits > 1) {
      epilogue_split(p, smem, o, st, sq, m0, head, batch, split);
      return;
    }
  }
  epilogue(p, smem, o, st, sq, m0, head, batch);
}

// Normalises O by the row sums, writes lse, and stores O through shared memory so that global
// writes are whole 16-byte chunks.  Rows that saw no key get O = 0 and lse = -inf.
template <class ElementTag, int kHeadDim, class Config, bool kKvcache_>
__device__ void FwdKernel<ElementTag, kHeadDim, Config, kKvcache_>::epilogue(
    const FwdParams& p, SharedStorage& smem, float (&o)[kMTiles][kDTiles][4], RowState& st,
    const SeqlenInfo& sq, int m0, int head, int batch) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_n = warp % kWarpsN;
  const int warp_row0 = warp / kWarpsN * kWarpRows;
  const int dim0 = warp_n * kWarpDims;
  float* lse = p.lse.ptr + batch * p.lse.batch_stride + head * p.lse.head_stride + sq.offset + m0;
  // The q tile is no longer read: every Q.K^T ended before the last iteration's second barrier.
  // With kBulkStore each row of O leaves in one bulk copy, so rows are staged contiguous
  // (PaddedRows: no chunk swap); otherwise the 16-byte copy-out below reads Rows.
  Element* so = smem.q;
  using StageRows = std::conditional_t<kBulkStore, PaddedRows<kHeadDim>, Rows>;
  static_assert(StageRows::kPitch <= kPitch, "the staged O fits q's buffer");
  if constexpr (kWarpsN > 1) {
    // Each warp's sums cover its keys only: add the partner's (quad-reduced) row sums.
    float sum[kMTiles][2];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        sum[mt][r] = quad_sum(st.sum[mt][r]);
      }
    share_rows(smem.sum[warp_n], sum, warp_row0, lane);
    pair_barrier(warp / kWarpsN);  // the partner's sums are written
    combine_rows(sum, smem.sum[warp_n ^ 1], warp_row0, lane,
                 [](float a, float b) { return a + b; });
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) st.sum[mt][r] = sum[mt][r];
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = st.sum[mt][r];
      if constexpr (kWarpsN == 1) sum = quad_sum(sum);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const int row = warp_row0 + mt * 16 + lane / 4 + r * 8;
      if (lane % 4 == 0 && warp_n == 0 && m0 + row < sq.extent) {
        lse[row] = sum > 0.f ? st.max[mt][r] * p.softmax_scale + logf(sum) : -INFINITY;
      }
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<uint32_t*>(so + StageRows::offset(row, dim0 + dt * 8 + (lane % 4) * 2)) =
            pack2<Element>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      }
    }
  Element* go = static_cast<Element*>(p.o.ptr) + batch * p.o.batch_stride +
                int64_t(sq.offset + m0) * p.o.row_stride + head * p.o.head_stride;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kBulkStore) {
    // The warps of a row range staged its rows; the range's first warp copies them out, a lane
    // per row.  The bulk copies read the rows through the async proxy: each thread orders its
    // stores before them, and the barrier covers the range's threads.
    static_assert(kWarpRows == 32, "Each lane copies one row, so a warp must own 32 rows.");
    fence_proxy_async_smem();
    if constexpr (kWarpsN > 1) {
      pair_barrier(warp / kWarpsN);  // the range's rows are staged and fenced
    } else {
      __syncwarp();  // the warp's rows are staged and fenced
    }
    const int row = warp_row0 + lane;
    if (warp_n == 0 && m0 + row < sq.extent) {
      bulk_store(go + row * p.o.row_stride, so + StageRows::offset(row, 0),
                 p.head_dim * int(sizeof(Element)));
      bulk_wait_read();  // the block's shared memory must outlive the copy's reads
    }
    return;
  }
#endif
  __syncthreads();  // the copy-out below reads rows written by other warps
  constexpr int kChunksPerRow = kHeadDim / 8;
  for (int chunk = threadIdx.x; chunk < kBlockM * kChunksPerRow; chunk += kThreads) {
    const int row = chunk / kChunksPerRow;
    const int col = (chunk % kChunksPerRow) * 8;
    if (m0 + row < sq.extent && col < p.head_dim) {
      *reinterpret_cast<uint4*>(go + row * p.o.row_stride + col) =
          *reinterpret_cast<const uint4*>(so + Rows::offset(row, col));
    }
  }
}

// Split-KV (Note [KV-cache forward]): this split's O, normalised over its own keys, and its
// lse, float32 and straight from registers (the rows are few; no staging).  Rows that saw none
// of the split's keys get O = 0 and lse = -inf, which the combine weighs as nothing.
template <class ElementTag, int kHeadDim, class Config, bool kKvcache_>
__device__ void FwdKernel<ElementTag, kHeadDim, Config, kKvcache_>::epilogue_split(
    const FwdParams& p, SharedStorage& smem, float (&o)[kMTiles][kDTiles][4], RowState& st,
    const SeqlenInfo& sq, int m0, int head, int batch, int split) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_n = warp % kWarpsN;
  const int warp_row0 = warp / kWarpsN * kWarpRows;
  const int dim0 = warp_n * kWarpDims;
  float sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) sum[mt][r] = quad_sum(st.sum[mt][r]);
  if constexpr (kWarpsN > 1) {  // each warp's sums cover its keys only
    share_rows(smem.sum[warp_n], sum, warp_row0, lane);
    pair_barrier(warp / kWarpsN);
    combine_rows(sum, smem.sum[warp_n ^ 1], warp_row0, lane,
                 [](float a, float b) { return a + b; });
  }
  const SplitArgs& sp = p.split;
  float* go = sp.o + split * sp.o_split_stride + batch * sp.o_batch_stride +
              head * sp.o_head_stride;
  float* gl = sp.lse + split * sp.lse_split_stride + batch * sp.lse_batch_stride +
              head * sp.lse_head_stride;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + mt * 16 + lane / 4 + r * 8;
      if (m0 + row >= sq.extent) continue;
      const int64_t packed_row = sq.offset + m0 + row;
      const float inv = sum[mt][r] > 0.f ? 1.f / sum[mt][r] : 0.f;
      if (lane % 4 == 0 && warp_n == 0) {
        gl[packed_row * sp.lse_row_stride] =
            sum[mt][r] > 0.f ? st.max[mt][r] * p.softmax_scale + logf(sum[mt][r]) : -INFINITY;
      }
      float* dst = go + packed_row * sp.o_row_stride;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const int col = dim0 + dt * 8 + (lane % 4) * 2;
        if (col < p.head_dim) {
          *reinterpret_cast<float2*>(dst + col) =
              make_float2(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
        }
      }
    }
}

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, Kernel::Config::kMinBlocksPerSm)
    fwd_kernel(const __grid_constant__ FwdParams params) {
  extern __shared__ __align__(16) char smem_buf[];
  Kernel::run(params, *reinterpret_cast<typename Kernel::SharedStorage*>(smem_buf));
}

// The decode kernel of a kTmaKeys config: its parameters and the caches' tensor maps, which TMA
// reads from the kernel's parameter space (Note [TMA key tiles]).
struct DecodeTmaParams {
  FwdParams fwd;
  CUtensorMap k, v;
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, Kernel::Config::kMinBlocksPerSm)
    fwd_kvcache_tma_kernel(const __grid_constant__ DecodeTmaParams params) {
  // TmaStorage's 1024-byte alignment is the dynamic shared memory's own (nothing is static).
  extern __shared__ __align__(1024) char smem_tma_buf[];
  Kernel::run(params.fwd, *reinterpret_cast<typename Kernel::SharedStorage*>(smem_tma_buf),
              &params.k, &params.v);
}

}  // namespace flash_cuda::sm80
