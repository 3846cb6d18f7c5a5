// Tile shapes of the portable (sm80) kernels, one table per direction.  Every entry fits the
// 163 KB of shared memory an sm80 block can have, so the same table serves sm80 and sm90.
#pragma once

namespace flash_cuda::sm80 {

// The most dynamic shared memory one block may opt in to on sm80 (A100); sm86/89 allow less
// (99 KB) and get a clear launch error for the larger entries, sm90 allows 227 KB.
constexpr int kMaxSmemBytesSm80 = 163 * 1024;

// Forward: kBlockM query rows per block, kBlockN keys per step, each warp owns kBlockM/kNWarps
// rows.  The binding resource is registers: a thread holds (rows per warp) x (kHeadDim + kBlockN)
// / 32 fp32 accumulators for O and S.
template <int kHeadDim> struct FwdTileConfig;
template <> struct FwdTileConfig<64> {  // O 64 + S 128 regs; kBlockN = 64: 4% slower
  static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4;
};
template <> struct FwdTileConfig<96> {  // O 96 + S 64 regs
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4;
};
template <> struct FwdTileConfig<128> {  // O 128 + S 64 regs; kBlockN = 32: 7% slower
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4;
};
template <> struct FwdTileConfig<192> {  // 16 rows per warp: O 96 + S 32 regs
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8;
};
template <> struct FwdTileConfig<256> {  // 16 rows per warp, 2 blocks per SM; 8 warps x 128 rows: 17% slower
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4;
};

// Backward: a block owns kBlockN keys (16 per warp) and walks the query blocks of kBlockM rows.
// A thread holds dK and dV for its 16 keys x kSliceDim columns (2 * kSliceDim / 8 fp32 regs) plus
// S^T and dP^T (kBlockM / 4 regs).  Past 128 columns that does not fit, so the head dim is split
// into kSlices blocks that each recompute S and dP (the price: 2 extra GEMMs of 5).
template <int kHeadDim> struct BwdTileConfig;
template <> struct BwdTileConfig<64> {  // S^T + dP^T 128 regs, dK + dV 64; smem 147 KB
  static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 8, kSlices = 1, kStages = 2;
};
template <> struct BwdTileConfig<96> {  // smem 125 KB
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kSlices = 1, kStages = 2;
};
template <> struct BwdTileConfig<128> {  // smem 157 KB: the sm80 limit allows two stages only here
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kSlices = 1, kStages = 2;
};
template <> struct BwdTileConfig<192> {  // kBlockM = 64 spills; smem 107 KB
  static constexpr int kBlockM = 32, kBlockN = 64, kNWarps = 4, kSlices = 2, kStages = 2;
};
template <> struct BwdTileConfig<256> {  // smem 106 KB: 2 blocks per SM; 64-row tiles: 10% slower
  static constexpr int kBlockM = 32, kBlockN = 64, kNWarps = 4, kSlices = 2, kStages = 1;
};

}  // namespace flash_cuda::sm80
