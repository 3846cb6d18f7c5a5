// The launch step every kernel family shares: opt in to the block's dynamic shared memory,
// launch on the caller's stream and report the launch error.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flash_cuda {

// Number of tiles of `tile` rows covering `rows` (64-bit: rows may be near INT_MAX).
inline unsigned tiles(int64_t rows, int tile) {
  return static_cast<unsigned>((rows + tile - 1) / tile);
}

template <class Params> cudaError_t launch_with_smem(void (*kernel)(Params), dim3 grid, int threads,
                                                     int smem_bytes, cudaStream_t stream,
                                                     const Params& params) {
  // Past 48 KB a kernel must opt in to more dynamic shared memory.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;  // nothing to do
  kernel<<<grid, threads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash_cuda
