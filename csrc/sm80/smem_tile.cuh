// Shared-memory tiles of the portable kernels: row-major with each row padded by 16 bytes, so
// the eight row addresses of one ldmatrix land in eight different 4-bank groups (no conflicts)
// for any row length that is a multiple of 16 elements (every compiled head dim), without a
// swizzle that would need power-of-2 rows.
#pragma once

#include <cstdint>

#include "common/ptx.cuh"

namespace flash_cuda::sm80 {

template <int kCols>
struct PaddedRows {
  static constexpr int kPitch = kCols + 8;  // elements; +8 x 2 bytes = one 16-byte bank group
};

// Asynchronously copies a kRows x kCols tile (row 0 at `gmem`, rows `row_stride` apart) into
// `smem` with 16-byte cp.async.  Rows >= rows_valid and columns >= cols_valid are zero-filled,
// which is what the MMAs need for ragged sequence ends and rounded-up head dims.
template <int kRows, int kCols, int kThreads, class Element>
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
      cp_async_16(smem + (row0 + i * kRowsPerPass) * PaddedRows<kCols>::kPitch + col,
                  valid ? src : gmem, valid);
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
      cp_async_16(smem + row * PaddedRows<kCols>::kPitch + col, src, valid);
    }
  }
}

}  // namespace flash_cuda::sm80
