// Shared-memory tiles of the portable kernels.  Two row layouts with one interface (kPitch,
// offset, lane_chunk_swap), both conflict-free for the eight row addresses of one ldmatrix
// without a power-of-2 row length:
// - PaddedRows: rows padded by 16 bytes (tiles written from registers: P, dS; and the forward's
//   tiles where the 16 extra bytes per row of CopyRows would not fit sm86/sm89's 99 KB);
// - CopyRows: tiles filled by cp.async from global memory (Q, K, V, dO).
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace flash_cuda::sm80 {

template <int kCols> struct PaddedRows {
  static constexpr int kPitch = kCols + 8;  // elements; +8 x 2 bytes = one 16-byte bank group
  static __device__ __forceinline__ int offset(int row, int col) { return row * kPitch + col; }
  static __device__ __forceinline__ int lane_chunk_swap(int) { return 0; }
};

// Rows padded to a multiple of 32 bytes, so that each 32-byte global sector a cp.async reads
// lands in one 32-byte shared-memory granule.  (With 16-byte padding every other row straddled
// granules and its sectors were fetched twice: 50% more L2 sectors than ideal, measured.)  A
// pitch of 8 words mod 32 would alias rows r and r + 4 in the banks, so rows whose bit 2 is set
// swap the two 16-byte chunks of every granule.  The swap stays inside a granule, keeps every
// offset additive for the ldmatrix lanes (whose rows are lane mod 8, see lane_chunk_swap), and
// moves rows 4-7 of a matrix by one bank group.
template <int kCols> struct CopyRows {
  static constexpr int kPitch = kCols + 16;
  static_assert(kCols % 16 == 0, "rows are whole 32-byte granules");
  // Element offset of (row, col).
  static __device__ __forceinline__ int offset(int row, int col) {
    return row * kPitch + (col ^ (((row >> 2) & 1) << 3));
  }
  // The chunk swap (0 or 1) of a row that is congruent to `lane` mod 8.
  static __device__ __forceinline__ int lane_chunk_swap(int lane) { return (lane >> 2) & 1; }
};

// Asynchronously copies a kRows x kCols tile (row 0 at `gmem`, rows `row_stride` apart) into
// `smem` (row layout Rows, CopyRows unless said otherwise) with 16-byte cp.async.  Rows >=
// rows_valid and columns >= cols_valid are zero-filled, which is what the MMAs need for ragged
// sequence ends and rounded-up head dims.
template <int kRows, int kCols, int kThreads, class Rows = CopyRows<kCols>, class Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem,
                                                int64_t row_stride, int rows_valid,
                                                int cols_valid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kCols % 8 == 0, "tiles are copied in 16-byte chunks of 8 elements");
  if constexpr (kThreads % kChunksPerRow == 0 && kChunks % kThreads == 0) {
    // Each thread keeps one column and walks rows kRowsPerPass apart: one 64-bit multiply per
    // tile instead of one per chunk.
    constexpr int kRowsPerPass = kThreads / kChunksPerRow;
    const int row0 = threadIdx.x / kChunksPerRow;
    const int col = (threadIdx.x % kChunksPerRow) * 8;
    const bool col_valid = col < cols_valid;
    const Element* src = gmem + row0 * row_stride + col;
    const int64_t step = kRowsPerPass * row_stride;
#pragma unroll
    for (int i = 0; i < kChunks / kThreads; ++i) {
      const bool valid = col_valid && row0 + i * kRowsPerPass < rows_valid;
      // An invalid chunk reads nothing; its source address is kept in bounds anyway.
      cp_async_16(smem + Rows::offset(row0 + i * kRowsPerPass, col), valid ? src : gmem, valid);
      src += step;
    }
  } else {
#pragma unroll
    for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
      const int chunk = threadIdx.x + i * kThreads;
      if (kChunks % kThreads != 0 && chunk >= kChunks) break;
      const int row = chunk / kChunksPerRow;
      const int col = (chunk % kChunksPerRow) * 8;
      const bool valid = row < rows_valid && col < cols_valid;
      const Element* src = valid ? gmem + row * row_stride + col : gmem;
      cp_async_16(smem + Rows::offset(row, col), src, valid);
    }
  }
}

// The same for a tile whose rows lie anywhere (the pages of a KV cache): row r starts at
// row_ptr(r), for r < rows_valid only.  Each thread computes the addresses of its own rows.
template <int kRows, int kCols, int kThreads, class Rows = CopyRows<kCols>, class Element,
          class RowPtr>
__device__ __forceinline__ void load_rows_async(Element* smem, const RowPtr& row_ptr,
                                                int rows_valid, int cols_valid,
                                                const Element* any_valid) {
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kCols % 8 == 0, "tiles are copied in 16-byte chunks of 8 elements");
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int chunk = threadIdx.x + i * kThreads;
    if (kChunks % kThreads != 0 && chunk >= kChunks) break;
    const int row = chunk / kChunksPerRow;
    const int col = (chunk % kChunksPerRow) * 8;
    const bool valid = row < rows_valid && col < cols_valid;
    // An invalid chunk reads nothing from `any_valid`, an address inside the tensor.
    const Element* src = valid ? row_ptr(row) + col : any_valid;
    cp_async_16(smem + Rows::offset(row, col), src, valid);
  }
}

}  // namespace flash_cuda::sm80
