// The order in which blocks take their (tile, head, batch): shared by the forward (a tile is a
// block of query rows) and the backward (a block of keys).  The launcher picks the grid with
// `BlockOrder`; the kernel maps its block index to a tile with `block_tile`.
//
// Note [Block order]
// The hardware hands out blocks roughly in launch order, so the order decides two things.
// - L2 reuse: the blocks of one (batch, head) pair read the same K and V (forward) or Q and dO
//   (backward); run together, they read them from device memory about once.
// - Balance under a causal or local mask: tiles differ in work, up to the number of tiles per
//   sequence.  When the pairs run one after the other, each pair's tiles heaviest first, the
//   last pair's heaviest tile starts when the others are almost done.
// So with a mask the heads are taken in groups of 2^shift: the grid's x walks the tile ranks of
// a group, each rank for every head of the group, and y the groups.  The heaviest tiles of the
// group go first and its lightest fill the end (rank 0 is the heaviest under a causal mask; a
// window bounded only on the left reverses the weights, and then rank 0 is the lightest).  A
// group's heads must divide the head count, and what they read (forward: K and V; backward: Q,
// dO and the dQ accumulator; counted per query head, so a GQA group is overestimated) must fit
// a third of L2.  Measured (benchmarks/NOTES.md entry 35): causal forward +5% at seqlen 8k-16k,
// backward +2-6% at 1k-8k.  Groups of more than 2 heads lost up to 2.6% in the portable
// forward at short sequences, so it takes at most 2, the backward up to 8.  The Hopper forward,
// whose persistent blocks take their tiles from a counter, takes up to 32 on dense queries
// (entry 64: +3-8% at 1k-4k under a causal mask).  Without a mask the order is launch order:
// heads one after the other.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flash_cuda {

struct BlockTile {
  int rank;  // 0 = the heaviest tile of its (batch, head)
  int head;
  int batch;
};

// The grid is (tiles << shift, heads >> shift, batch).
__device__ __forceinline__ BlockTile block_tile(int shift) {
  const int x = blockIdx.x;
  return {x >> shift, (int(blockIdx.y) << shift) + (x & ((1 << shift) - 1)), int(blockIdx.z)};
}

// The same for block (x, y, z) of that grid, taken in turn by a persistent block.
__device__ __forceinline__ BlockTile block_tile(int shift, int x, int y, int z) {
  return {x >> shift, (y << shift) + (x & ((1 << shift) - 1)), z};
}

// Host: the grid for `tiles` tiles per (batch, head) and the shift that block_tile reads.
struct BlockOrder {
  dim3 grid;
  int shift;
  // `uneven`: tiles differ in work (a causal or local mask).  `bytes_per_head`: what the blocks
  // of one (batch, head) read again and again.  At most 2^max_shift heads per group.
  BlockOrder(unsigned tiles, int heads, int batch, bool uneven, int64_t bytes_per_head,
             int max_shift)
      : grid(tiles, heads, batch), shift(0) {
    if (!uneven) return;
    int device = 0, l2_bytes = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device) != cudaSuccess) {
      // The order is a hint: clear the error; the launch repeats these calls and reports it.
      cudaGetLastError();
      return;
    }
    const int64_t budget = int64_t(l2_bytes) / 3;
    while (shift < max_shift && heads % (2 << shift) == 0 &&
           (int64_t(2) << shift) * bytes_per_head <= budget &&
           (int64_t(tiles) << (shift + 1)) < (int64_t(1) << 31)) {
      ++shift;
    }
    grid = dim3(tiles << shift, heads >> shift, batch);
  }
};

}  // namespace flash_cuda
