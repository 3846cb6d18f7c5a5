// One warp's tile of C += A . B on mma.sync m16n8k16 with both operands in padded shared memory
// (see smem_tile.cuh).  The operand layouts are compile-time flags, so one routine serves every
// GEMM of the backward: ldmatrix for operands stored with k contiguous, ldmatrix.trans for
// operands stored with m (A) or n (B) contiguous.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"
#include "common/seqlen_info.cuh"

namespace flash_cuda::sm80 {

// Where a warp tile's operands live: A(m, k) at a[m * lda + k], or at a[k * lda + m] when
// kATrans; B(k, n) at b[n * ldb + k], or at b[k * ldb + n] when kBTrans.  kASwap / kBSwap: the
// operand is a CopyRows tile (see smem_tile.cuh), whose rows with bit 2 set swap the two
// 16-byte chunks of each 32-byte granule; the warp tile must then start on a row that is a
// multiple of 8 and a column that is a multiple of 16.
template <bool kATrans, bool kBTrans, bool kASwap = false, bool kBSwap = false>
struct OperandLayout {
  static constexpr bool kA = kATrans;
  static constexpr bool kB = kBTrans;
  static constexpr bool kASw = kASwap;
  static constexpr bool kBSw = kBSwap;
};

// acc (kM x kN, m16n8 accumulator tiles) += A (kM x kK) . B (kK x kN).  kPrefetch: the fragments
// of k-step ks + 1 are loaded before the MMAs of step ks, so that no MMA waits for the ldmatrix
// that feeds it, at the cost of holding two k-steps of fragments; otherwise each B fragment is
// loaded right before the MMAs that read it (fewest live registers).
template <int kM, int kN, int kK, class Layout, bool kPrefetch = false, class Element>
__device__ __forceinline__ void warp_gemm(float (&acc)[kM / 16][kN / 8][4], const Element* a,
                                          int lda, const Element* b, int ldb, int lane) {
  static_assert(kM % 16 == 0 && kN % 16 == 0 && kK % 16 == 0,
                "warp tiles are whole m16 x n16 x k16 steps");
  // Lane offsets of the four 8x8 matrices one ldmatrix.x4 fetches (each lane names one row;
  // that row is lane mod 8, so its chunk swap is a per-lane constant).  A, k contiguous:
  // (rows 0-7 | 8-15) x (k 0-7 | 8-15).  A, m contiguous: the same four matrices addressed by
  // their k rows.  B likewise, as two n8 tiles of one k16 step.
  const int swap = (lane >> 2) & 1;
  const int a_swap = Layout::kASw ? swap : 0;
  const int b_swap = Layout::kBSw ? swap : 0;
  const Element* a_lane =
      Layout::kA ? a + (lane % 8 + (lane / 16) * 8) * lda + (((lane / 8) % 2) ^ a_swap) * 8
                 : a + (lane % 16) * lda + ((lane / 16) ^ a_swap) * 8;
  const Element* b_lane =
      Layout::kB ? b + (lane % 8 + ((lane / 8) % 2) * 8) * ldb + ((lane / 16) ^ b_swap) * 8
                 : b + (lane % 8 + (lane / 16) * 8) * ldb + (((lane / 8) % 2) ^ b_swap) * 8;
  if constexpr (kPrefetch) {
    auto load_a = [&](uint32_t(&ra)[kM / 16][4], int ks) {
#pragma unroll
      for (int mt = 0; mt < kM / 16; ++mt) {
        if constexpr (Layout::kA) {
          ldmatrix_x4_trans(ra[mt], a_lane + ks * 16 * lda + mt * 16);
        } else {
          ldmatrix_x4(ra[mt], a_lane + mt * 16 * lda + ks * 16);
        }
      }
    };
    auto load_b = [&](uint32_t(&rb)[4], int ks, int np) {
      if constexpr (Layout::kB) {
        ldmatrix_x4_trans(rb, b_lane + ks * 16 * ldb + np * 16);
      } else {
        ldmatrix_x4(rb, b_lane + np * 16 * ldb + ks * 16);
      }
    };
    auto mma = [&](const uint32_t(&ra)[kM / 16][4], const uint32_t(&rb)[4], int np) {
#pragma unroll
      for (int mt = 0; mt < kM / 16; ++mt) {
        mma_16816<Element>(acc[mt][2 * np], ra[mt], rb[0], rb[1]);
        mma_16816<Element>(acc[mt][2 * np + 1], ra[mt], rb[2], rb[3]);
      }
    };
    uint32_t ra[2][kM / 16][4], rb[2][kN / 16][4];
#pragma unroll
    for (int ks = 0; ks <= kK / 16; ++ks) {
      if (ks < kK / 16) {  // step ks's fragments, one step ahead of its MMAs
        load_a(ra[ks % 2], ks);
#pragma unroll
        for (int np = 0; np < kN / 16; ++np) load_b(rb[ks % 2][np], ks, np);
      }
      if (ks > 0) {
#pragma unroll
        for (int np = 0; np < kN / 16; ++np) mma(ra[(ks - 1) % 2], rb[(ks - 1) % 2][np], np);
      }
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < kK / 16; ++ks) {
      uint32_t ra[kM / 16][4];
#pragma unroll
      for (int mt = 0; mt < kM / 16; ++mt) {
        if constexpr (Layout::kA) {
          ldmatrix_x4_trans(ra[mt], a_lane + ks * 16 * lda + mt * 16);
        } else {
          ldmatrix_x4(ra[mt], a_lane + mt * 16 * lda + ks * 16);
        }
      }
#pragma unroll
      for (int np = 0; np < kN / 16; ++np) {
        uint32_t rb[4];
        if constexpr (Layout::kB) {
          ldmatrix_x4_trans(rb, b_lane + ks * 16 * ldb + np * 16);
        } else {
          ldmatrix_x4(rb, b_lane + np * 16 * ldb + ks * 16);
        }
#pragma unroll
        for (int mt = 0; mt < kM / 16; ++mt) {
          mma_16816<Element>(acc[mt][2 * np], ra[mt], rb[0], rb[1]);
          mma_16816<Element>(acc[mt][2 * np + 1], ra[mt], rb[2], rb[3]);
        }
      }
    }
  }
}

template <int kMTiles, int kNTiles>
__device__ __forceinline__ void zero(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
      acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;
}

// Sets to -inf the elements of a warp's m16n8 accumulator tiles (rows from row0, keys from
// col0) that `mask` hides.  Each row's visible key range is computed once, so the test per
// element is one compare against compile-time column offsets.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ void apply_mask(float (&s)[kMTiles][kNTiles][4], const MaskInfo& mask,
                                           int row0, int col0, int lane) {
  const int col_base = col0 + (lane % 4) * 2;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int lo, hi;
      mask.visible_keys(row0 + mt * 16 + lane / 4 + r * 8, lo, hi);
      lo -= col_base;
      hi -= col_base;
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = nt * 8 + e;
          if (c < lo || c >= hi) s[mt][nt][2 * r + e] = -INFINITY;
        }
    }
}

}  // namespace flash_cuda::sm80
