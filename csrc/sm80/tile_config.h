// Tile shapes of the portable (sm80) kernels, one table per direction.  The base entries fit the
// 163 KB of shared memory an sm80 block can have; the backward has a second table for sm90 and
// later, whose 227 KB let it double-buffer Q and dO.
#pragma once

namespace flash_cuda::sm80 {

// The most dynamic shared memory one block may opt in to: sm80 (A100) 163 KB; sm86/sm89 99 KB,
// where every backward entry and the forward at head dims 161-192 fail with a clear launch
// error; sm90 and sm100 227 KB; sm120 99 KB again, and it runs code compiled for sm90 (the
// default build's PTX), so that code must not assume more than 99 KB where sm86 cannot.
constexpr int kMaxSmemBytesSm80 = 163 * 1024;
constexpr int kMaxSmemBytesSm86 = 99 * 1024;
constexpr int kMaxSmemBytesSm90 = 227 * 1024;

// Forward: kBlockM query rows per block, kBlockN keys per step; the warps form kNWarps /
// kWarpsN row ranges, and the kWarpsN warps of a range split its keys (S) and head dims (O).
// The binding resources are registers, a thread holding (rows per warp) x (kHeadDim + kBlockN)
// / (32 kWarpsN) fp32 accumulators for O and S, and at 16 rows per warp the shared-memory
// bandwidth of the ldmatrix loads, which kWarpsN = 2 cuts by a third (32-row warps).
// kCopyRows: the tiles use the CopyRows layout (+1-5%, entry 15 of benchmarks/NOTES.md) rather
// than 16-byte padding.  kPrologueV: the prologue loads the first V tile with Q and K (+0-5% at
// hdims 64 and 256, entry 26; untimed at 96 and 192).  kBulkStoreO: on sm90+ the epilogue copies
// each row of O to global memory in one bulk copy (+0.5-1.4% at hdims 128 and 256, entry 33; at
// hdim 64 it spills and loses 2.5%).  An entry that needs more than the 99 KB
// of an sm86/sm89/sm120 block names a FwdTileConfigSmall (kHasSmallTile), which the launcher
// runs on those GPUs.
struct FwdTable {
  static constexpr int kMaxSmemBytes = kMaxSmemBytesSm80;
  static constexpr int kWarpsN = 1;
  static constexpr int kKvStages = 1;         // see FwdDecodeTileConfig
  static constexpr int kMinBlocksPerSm = 0;   // see FwdDecodeTileConfig (0: no bound)
  static constexpr bool kPrefetchPages = false;  // see FwdDecodeTileConfig
  static constexpr bool kPrologueV = true;
  static constexpr bool kHasSmallTile = false;
  static constexpr bool kBulkStoreO = false;
  static constexpr bool kTmaKeys = false;     // see FwdDecodeTmaTileConfig
};
template <int kHeadDim> struct FwdTileConfig;
template <> struct FwdTileConfig<64> : FwdTable {  // O 64 + S 128 regs; kBlockN = 64: 4% slower
  static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 4;
  static constexpr bool kCopyRows = true;
};
template <> struct FwdTileConfig<96> : FwdTable {  // O 96 + S 64 regs
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4;
  static constexpr bool kCopyRows = true;
};
template <> struct FwdTileConfig<128> : FwdTable {  // O 128 + S 64 regs; kBlockN = 32: 7% slower
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 4;
  static constexpr bool kCopyRows = true;
  static constexpr bool kPrologueV = false;  // 0-3% slower with it (NOTES entry 26)
  static constexpr bool kBulkStoreO = true;  // +0.5% (NOTES entry 33)
};
template <> struct FwdTileConfig<192> : FwdTable {  // 16 rows per warp: O 96 + S 32 regs
  static constexpr int kBlockM = 128, kBlockN = 64, kNWarps = 8;
  static constexpr bool kCopyRows = true;
};
// 2 x 2 warps of 32 rows x (32 keys of S | 128 dims of O): O 128 + S 32 regs; 112 KB, 2 blocks
// per SM on sm90.  4 x 1 warps of 16 rows: -6%; 128 rows, 4 x 2 warps, 1 block/SM: -10%.
template <> struct FwdTileConfig<256> : FwdTable {
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4;
  static constexpr int kWarpsN = 2;
  static constexpr bool kCopyRows = true;
  static constexpr bool kHasSmallTile = true;
  static constexpr bool kBulkStoreO = true;  // +0-1.4%, most at short sequences (NOTES entry 33)
};

// The forward's tiles on GPUs whose blocks have 99 KB of shared memory (sm86, sm89, sm120), for
// the head dims whose FwdTileConfig needs more (kHasSmallTile); the launcher picks by the
// device's limit.
template <int kHeadDim> struct FwdTileConfigSmall;
template <> struct FwdTileConfigSmall<256> : FwdTable {  // 16 rows/warp, no exchange: 99 KB
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 4;
  static constexpr bool kCopyRows = false;  // CopyRows would need 102 KB
};

// The KV-cache forward's tiles for a decode step (at most kBlockM query rows per head after GQA
// packing): one warp of 16 rows, and kKvStages key tiles of K and V in flight (Note [Staged key
// tiles] in sm80/fwd_kernel.cuh); with kPrefetchPages a paged cache's table is read a step
// ahead.  A step reads far more keys than it computes on, and the kernel is bound by the
// instructions its few warps issue per byte (NOTES entry 48: 4-5 cycles per issued
// instruction), so blocks are small (20 KB at hdim 128; 8 per SM, a limit set by registers).
// Measured at hdim 128 (bf16, H200, decode GQA 32/8): 16 keys x 2 stages beat 32 x 2, 32 x 3,
// 32 x 4, 16 x 4 and 64 x 2 at every batch >= 4, dense and paged.
template <int kHeadDim, int kStages = 2, int kKeys = 16, bool kPrefetch = true>
struct FwdDecodeTileConfig : FwdTable {
  static constexpr int kBlockM = 16, kBlockN = kKeys, kNWarps = 1;
  static constexpr int kKvStages = kStages;
  static constexpr bool kPrefetchPages = kPrefetch;
  static constexpr bool kCopyRows = true;
  // Blocks an SM must hold by registers (launch bounds): up to head dim 128 more warps hide
  // the latency the kernel is bound by (ptxas: 168 registers at 128, no spill; 128 spilled 136
  // bytes); at 256 shared memory allows 5 blocks whatever the registers.
  static constexpr int kMinBlocksPerSm = kHeadDim <= 64 ? 16 : kHeadDim <= 128 ? 12 : 0;
};

// The decode tiles with their key tiles loaded by TMA in sm90 code (Note [TMA key tiles] in
// sm80/fwd_kernel.cuh): head dims that are whole 64-column blocks, caches TMA can address
// (launch_fwd_kvcache.cuh: decode_tma_fits); the launcher runs FwdDecodeTileConfig elsewhere.
template <int kHeadDim> struct FwdDecodeTmaTileConfig : FwdDecodeTileConfig<kHeadDim> {
  static_assert(kHeadDim % 64 == 0, "key tiles are 64-column TMA boxes");
  static constexpr bool kTmaKeys = true;
  static constexpr int kMaxSmemBytes = kMaxSmemBytesSm90;
};

// The KV-cache forward's tiles beyond decode (chunked prefill, longer queries): the forward's
// tile with two stages of key tiles in flight and a paged table read a step ahead (Note
// [Staged key tiles]), where its warps do not split the keys (kWarpsN == 1) and two stages
// keep the block within the 99 KB of an sm86 block: head dim 96 as the forward, 64 with 64-key
// tiles (128 would need 110 KB), 128 with 32-key tiles (64 would need 104 KB).  One stage looked
// each key row's page up as its copy was issued (NOTES entry 84).
template <int kHeadDim>
struct FwdKvcacheTileConfig : FwdTileConfig<kHeadDim> {
  static constexpr int kKvStages =
      FwdTileConfig<kHeadDim>::kWarpsN == 1 && kHeadDim <= 96 ? 2 : 1;
  static constexpr bool kPrefetchPages = kKvStages > 1;
};
template <> struct FwdKvcacheTileConfig<64> : FwdTileConfig<64> {
  static constexpr int kBlockN = 64;
  static constexpr int kKvStages = 2;
  static constexpr bool kPrefetchPages = true;
};
template <> struct FwdKvcacheTileConfig<128> : FwdTileConfig<128> {
  static constexpr int kBlockN = 32;
  static constexpr int kKvStages = 2;
  static constexpr bool kPrefetchPages = true;
};

// Backward: a block owns kBlockN keys and walks the query tiles of kBlockM rows that see them.
// Each of its five GEMMs splits over the warps in its own layout (warps along the first dim x
// the rest): S = Q K^T and dP = dO V^T (kSdpWarpsM), dV += P^T dO and dK += dS^T Q
// (kKvWarpsN), dQ = dS K (kDqWarpsM, in kDqChunks column chunks); P and dS pass through shared
// memory.  The binding resource is registers: dK and dV live in them for the whole block
// (2 * kBlockN * kHeadDim / threads fp32 each), S and dP for one query tile (2 * kBlockM *
// kBlockN / threads).  Q (and dO) are double-buffered where shared memory allows (kStagesQ,
// kStagesDo).  kDqVec: values per dQ reduction (sm90 has a 16-byte red.v4; before it, scalar).
// kGemmPrefetch: the GEMMs load each k-step's fragments one step ahead (warp_gemm): +0.5-2% at
// hdims 64 and 128, -3% at 256, where the registers are short (benchmarks/NOTES.md entry 22).
//
// Rows of the float32 dQ accumulator (in the backward's workspace, laid out by launch_bwd.cuh)
// are allocated in whole tiles of this many rows (the largest backward kBlockM): dense, per
// (batch, head), round_up(seqlen_q, kDqAccumRowAlign) rows; varlen, per head, total_q + batch *
// kDqAccumRowAlign rows, where sequence b's tiles start at row floor((cu_seqlens_q[b] + b *
// kBlockM) / kBlockM) * kBlockM (room for its last partial tile without touching the next
// sequence's).  Inside a tile the order is the kernel's own (see DqAccumLayout in
// sm80/bwd_kernel.cuh): only the backward kernel and its dQ conversion read it.
constexpr int kDqAccumRowAlign = 128;

// Each table serves the compute capabilities [kMinArch, kEndArch); the launcher picks by the
// code the GPU runs and the kernel body is compiled only there.
struct BwdTableSm80 {  // what every entry of the sm80 table shares
  static constexpr int kMinArch = 80, kEndArch = 90, kMaxSmemBytes = kMaxSmemBytesSm80;
  static constexpr int kDqVec = 1, kDqChunks = 1;
};
template <int kHeadDim> struct BwdTileConfig;
template <> struct BwdTileConfig<64> : BwdTableSm80 {  // dK+dV 64, S+dP 128 regs; 150 KB; 1 Q stage
  static constexpr int kBlockM = 128, kBlockN = 128, kNWarps = 8, kStagesQ = 1, kStagesDo = 1;
  static constexpr int kSdpWarpsM = 2, kKvWarpsN = 4, kDqWarpsM = 4;
  static constexpr bool kGemmPrefetch = true;
};
template <> struct BwdTileConfig<96> : BwdTableSm80 {  // dK+dV 96 regs, S+dP 64; smem 147 KB
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kStagesQ = 2, kStagesDo = 2;
  static constexpr int kSdpWarpsM = 2, kKvWarpsN = 4, kDqWarpsM = 4;
  static constexpr bool kGemmPrefetch = true;
};
template <> struct BwdTileConfig<128> : BwdTableSm80 {  // dK+dV 128 regs, S+dP 64; smem 161 KB
  static constexpr int kBlockM = 64, kBlockN = 128, kNWarps = 8, kStagesQ = 2, kStagesDo = 1;
  static constexpr int kSdpWarpsM = 2, kKvWarpsN = 4, kDqWarpsM = 2;
  static constexpr bool kGemmPrefetch = true;
};
template <> struct BwdTileConfig<192> : BwdTableSm80 {  // dK+dV 96 regs, S+dP 32; smem 149 KB
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 8, kStagesQ = 2, kStagesDo = 1;
  static constexpr int kSdpWarpsM = 4, kKvWarpsN = 2, kDqWarpsM = 2;
  static constexpr bool kGemmPrefetch = false;
};
template <> struct BwdTileConfig<256> : BwdTableSm80 {  // dK+dV 128, S+dP 32 regs; 155 KB; 1 stage
  static constexpr int kBlockM = 64, kBlockN = 64, kNWarps = 8, kStagesQ = 1, kStagesDo = 1;
  static constexpr int kSdpWarpsM = 4, kKvWarpsN = 2, kDqWarpsM = 2;
  static constexpr bool kGemmPrefetch = false;
};

// sm90 and later: the same tiles, with 16-byte dQ reductions, and the 227 KB spent on a second
// Q and dO stage (+1-3% each, entry 12 of benchmarks/NOTES.md).  Head dim 256 computes its dQ
// tile in two column chunks (32 fewer live registers).
template <int kHeadDim> struct BwdTileConfigSm90
    : BwdTileConfig<kHeadDim> {  // smem 190 / 147 / 179 / 175 / 223 KB
  static constexpr int kStagesQ = 2, kStagesDo = 2;
  static constexpr int kDqVec = 4;
  static constexpr int kDqChunks = kHeadDim == 256 ? 2 : 1;
  static constexpr int kMinArch = 90, kEndArch = 1000, kMaxSmemBytes = kMaxSmemBytesSm90;
};

#if defined(__CUDA_ARCH__)
// Whether this compilation pass builds the kernel bodies of a table: each table's are compiled
// only for the archs its launcher picks it on, which keeps the compile time of two tables that
// of one.  Elsewhere a table's kernels trap rather than return nothing.
template <class Config> constexpr bool compiled_here() {
  return Config::kMinArch * 10 <= __CUDA_ARCH__ && __CUDA_ARCH__ < Config::kEndArch * 10;
}
#endif

}  // namespace flash_cuda::sm80
