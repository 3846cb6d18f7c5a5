// Tile shapes of the Hopper (sm90) forward kernels, one entry per compiled head dim, and the
// register split between the producer and the consumer warp groups that follows from them.
#pragma once

#include <type_traits>

namespace flash_cuda::sm90 {

// The most dynamic shared memory an sm90 block may opt in to (H100, H200, H20, GH200).
constexpr int kMaxSmemBytes = 227 * 1024;

// kBlockM query rows per block, 64 per consumer warp group (wgmma's M); kBlockN keys per stage;
// kStages stages of K and of V in the TMA ring.  The binding resources: shared memory (Q once,
// K and V per stage, all 16-bit: (kBlockM + 2 kStages kBlockN) kHeadDim 2 bytes <= 227 KB) and
// the consumers' registers, which hold O (kHeadDim / 2 fp32 per thread), S (kBlockN / 2) and
// P (kBlockN / 4) of their 64 rows.
// kPingPong: the consumer warp groups take turns issuing every GEMM (Note [Hopper forward
// pipeline]), so that one's softmax runs under the others' wgmma.  Off everywhere: timed alone
// at head dims 64, 128 and 256 it lost 2-7% at most points of the grid (NOTES entries 44, 51),
// and at 128 again, with uniform descriptors, 2-4% at 2k-16k (entry 57).
// kPersistent: one block per SM takes tiles in turn from a tile counter (Note [Hopper forward
// pipeline]), which hides each tile's set-up and epilogue under the next tile's loads; otherwise
// one block per tile.  At head dims 192 and 256 shared memory holds no buffer for O beside Q's:
// persistent, O is staged in V's stages (kOInV).  On at 256: +0.6-5.9% at seqlen 512-4k (most
// under a causal mask), 0 at 16k (NOTES entry 63); before, with O staged in Q's buffer so that
// the next Q waited for the epilogue, persistent ran 2-9% below one block per tile (entries 47,
// 58).  Off at 192 (untimed).
// kPerWarpGroupKeys: each consumer warp group visits only the key tiles its own rows see (Note
// [Hopper forward pipeline]).  On at head dim 64, whose 192-row tiles hold warp groups that
// see a quarter fewer key tiles under a causal mask at seqlen 512-1k (+19% there, +11% at 2k,
// NOTES entry 52); off at 96-256, where it skips little and its code alone cost 5-10% (the
// loop's schedule; at 256 the spills grew from 28 to 100 bytes).
// kRescaleUnderS: O is rescaled by the last softmax step's correction between the issue of the
// next S = Q K^T and that of P V (O is no GEMM's operand there, and the tensor cores are busy),
// rather than after the P V wait, where the rescale's FMULs delay the next S.  On at head dims
// 256 (+3-7% at seqlen 2k-16k, NOTES entry 53) and 64 (+4% at 16k, +2% at causal 2k, -2.5% at
// non-causal 512, entry 57; it had lost 1.5-3% before entry 56's uniform descriptors); off at
// 128 (within 1%, entry 53); 96 and 192 untimed.
// kMaskFreeLoop: the key tiles a warp group's rows see whole (one run) take a copy of the key
// loop without the mask's code, so that the hot loop is one block of straight-line code.  On at
// head dims 64 (+6% at seqlen 16k, -2% at 512, NOTES entry 54), 128 (+1.5% at 16k, -2% at
// non-causal 512, entry 57) and 256 (0 to +0.6%, entry 57); at 128 and 256 it had lost up to
// 4.5% before entry 56's uniform descriptors.  96 and 192 untimed.
// kPrefetchQ: Q in two buffers, the next tile's claimed and its Q issued while the producer
// loads this tile's last kPrefetchQLead + 1 key tiles (Note [Hopper forward pipeline]); needs
// kPersistent and room for O's own buffer.  On at head dims 64, 96 and 128: +8-9% at seqlen
// 512, -1.5 to +4% at 1k-2k, 0 at 16k at 128 but -3 to -5% at 16k at 64 (NOTES entry 60), of
// which the producer's key loop split around the Q issue won back 1-1.5%, and 1-5% at 512-2k
// at 64 (entry 62); 96 untimed (it shares 128's shape).  A lead of 4 key tiles ran 0-3% below a
// lead of 1.
// kStages 3 at head dim 64 (168 KB of shared memory with the second Q buffer and O's own):
// +1-1.6% at causal 1k-16k over 2 stages, within 0.3% non-causal (NOTES entry 62).
// kFastDivide: a tile index divides into its (query tile, head, batch) and a head into its K / V
// head by multipliers the launcher precomputes (cutlass::FastDivmod) rather than by `/`, some
// 20 instructions and a MUFU.RCP per division, 4-5 divisions per tile in each warp group, on
// the path between two tiles.  On at head dims 64 (within 1%), 96 (untimed: 128's shape) and
// 128 (+4-6% at seqlen 512-2k, 0 at 16k; ptxas spills 116 / 124 -> 40 / 40 bytes, NOTES entry
// 65); off at 256, where it ran +1-2% at 512-1k but -2 to -3% at 16k (ptxas scheduled the key
// loop's softmax differently), and at 192 (one tile per block, one division; untimed).
// kAlignLastTile: under a mask with a right bound (causal), a sequence's query tiles end within
// 64 rows of its last row, so that a partial tile is the first one, whose rows see the fewest
// keys (at head dim 64, seqlen 512, the tiles of 192 rows cover rows [-64, 512), and no tile's
// slowest warp group runs 4 key tiles beside one with none: 8 key tiles on the slowest warp
// groups of a sequence rather than 9).  Whole warp groups only: one before the sequence
// computes and stores nothing, and the others read their Q 64 or 128 rows down in its buffer.
// Each warp group computes the rows it would without the flag on the same key range, so out
// and lse are bitwise the same.  On at head dim 64 (+3-4% at causal 512-1k, within 1% from 2k
// on; NOTES entry 67); it needs kPersistent, kPerWarpGroupKeys and O staged outside Q's buffer
// (static_asserts in fwd_kernel.cuh), which no other head dim has.
// kSharedWork (persistent): the producer, which decodes each tile's Work (query tile, heads,
// batch, sequence ranges, key range) to claim it, writes it to shared memory with the tile's
// index, and the consumer warp groups read it there instead of decoding it again between Q's
// release and their first S (~0.5k of the ~1k cycles of scalar set-up there at head dim 64,
// NOTES entry 74).  On at head dim 64 (+3-5% at every point timed); off at 128, where it lost
// 0.2-4% (NOTES entry 75; 1-2.4% again with the producer decoding each tile once, entry 76), at
// 256, where that form won 1.5-2% at seqlen 512-1k and lost 2-2.5% at 16k (entry 76), and at the
// head dims not timed.
// Head dim 64 takes 3 consumer warp groups at 160 registers, and spills (NOTES gives the bytes
// per commit): 2 warp groups at 240 registers do not spill but ran 3-14% slower (entry 44).
// Head dim 96 takes 128's shape: at 3 x 160 registers its O, S and P left ptxas too few
// registers, and it ran every wgmma one at a time (C7512); the 2 x 240 shape ran 13-24% faster
// at every point timed (NOTES entry 55).
template <int kHeadDim> struct FwdTileConfig;
template <> struct FwdTileConfig<64> {  // 3 consumer warp groups x 160 registers; 168 KB
  static constexpr int kBlockM = 192, kBlockN = 128, kStages = 3;
  static constexpr bool kPingPong = false;
  static constexpr bool kPersistent = true;
  static constexpr bool kPerWarpGroupKeys = true;
  static constexpr bool kRescaleUnderS = true;
  static constexpr bool kMaskFreeLoop = true;
  static constexpr bool kPrefetchQ = true;
  static constexpr int kPrefetchQLead = 1;
  static constexpr bool kFastDivide = true;
  static constexpr bool kAlignLastTile = true;
  static constexpr bool kSharedWork = true;
};
template <> struct FwdTileConfig<96> {  // 2 consumer warp groups x 240: O 48 + S 64 + P 32
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kPersistent = true;
  static constexpr bool kPerWarpGroupKeys = false;
  static constexpr bool kRescaleUnderS = false;
  static constexpr bool kMaskFreeLoop = false;
  static constexpr bool kPrefetchQ = true;
  static constexpr int kPrefetchQLead = 1;
  static constexpr bool kFastDivide = true;
  static constexpr bool kAlignLastTile = false;
  static constexpr bool kSharedWork = false;
};
template <> struct FwdTileConfig<128> {  // 2 consumer warp groups x 240: O 64 + S 64 + P 32
  static constexpr int kBlockM = 128, kBlockN = 128, kStages = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kPersistent = true;
  static constexpr bool kPerWarpGroupKeys = false;
  static constexpr bool kRescaleUnderS = false;
  static constexpr bool kMaskFreeLoop = true;
  static constexpr bool kPrefetchQ = true;
  static constexpr int kPrefetchQLead = 1;
  static constexpr bool kFastDivide = true;
  static constexpr bool kAlignLastTile = false;
  static constexpr bool kSharedWork = false;
};
template <> struct FwdTileConfig<192> {  // registers: O 96 + S 48 + P 24; 193 KB
  static constexpr int kBlockM = 128, kBlockN = 96, kStages = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kPersistent = false;
  static constexpr bool kPerWarpGroupKeys = false;
  static constexpr bool kRescaleUnderS = false;
  static constexpr bool kMaskFreeLoop = false;
  static constexpr bool kPrefetchQ = false;
  static constexpr int kPrefetchQLead = 1;
  static constexpr bool kFastDivide = false;
  static constexpr bool kAlignLastTile = false;
  static constexpr bool kSharedWork = false;
};
template <> struct FwdTileConfig<256> {  // shared memory: 225 KB
  static constexpr int kBlockM = 128, kBlockN = 80, kStages = 2;
  static constexpr bool kPingPong = false;
  static constexpr bool kPersistent = true;
  static constexpr bool kPerWarpGroupKeys = false;
  static constexpr bool kRescaleUnderS = true;
  static constexpr bool kMaskFreeLoop = true;
  static constexpr bool kPrefetchQ = false;
  static constexpr int kPrefetchQLead = 1;
  static constexpr bool kFastDivide = false;
  static constexpr bool kAlignLastTile = false;
  static constexpr bool kSharedWork = false;
};

// The forward's tiles of a KV cache read in place (sm90/launch_fwd_kvcache.cuh, Note [Keys in
// place]): Base's, with K and V addressed through the cache's page table or cache_batch_idx.
template <class Base> struct CacheKeysConfig : Base {
  static constexpr bool kCacheKeys = true;
};
// Whether a kernel of kBlockN-key tiles reads pages in place (of a multiple of kBlockN rows):
// where kBlockN is a power of two (head dims up to 128), as page sizes are.
constexpr bool pages_in_place(int block_n) { return (block_n & (block_n - 1)) == 0; }
template <class Config, class = void> struct reads_cache_keys : std::false_type {};
template <class Config>
struct reads_cache_keys<Config, std::void_t<decltype(Config::kCacheKeys)>>
    : std::bool_constant<Config::kCacheKeys> {};

// The register split.  A block of kThreads threads (launch bounds: one block per SM) gets
// 64K / kThreads registers per thread at launch, in multiples of 8; setmaxnreg only moves that
// pool between the warp groups (an increase waits for the registers a decrease freed, so a
// split that asks for more than the pool never proceeds).  The producer warp group keeps
// kProducerRegs per thread and each consumer warp group the rest, in multiples of 8.
template <int kConsumerWarpGroups> struct RegisterSplit {
  static constexpr int kThreads = (kConsumerWarpGroups + 1) * 128;
  static constexpr int kLaunchRegs = 65536 / kThreads / 8 * 8;
  static constexpr int kProducerRegs = kConsumerWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs =
      (kLaunchRegs * kThreads / 128 - kProducerRegs) / kConsumerWarpGroups / 8 * 8;
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWarpGroups <=
                    kLaunchRegs * kThreads,
                "the split fits the registers the block was launched with");
  static_assert(kConsumerRegs <= 256 && kConsumerRegs >= 128, "setmaxnreg's range");
};

}  // namespace flash_cuda::sm90
