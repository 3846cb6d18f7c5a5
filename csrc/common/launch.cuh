// The launch step every kernel family shares: opt in to the block's dynamic shared memory,
// launch on the caller's stream and report the launch error.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <utility>

namespace flash_cuda {

// Number of tiles of `tile` rows covering `rows` (64-bit: rows may be near INT_MAX).
inline unsigned tiles(int64_t rows, int tile) {
  return static_cast<unsigned>((rows + tile - 1) / tile);
}

// The dynamic shared memory a block may opt in to on the current device, in bytes.  The
// environment variable FLASH_CUDA_SMEM_LIMIT_KB (read once) lowers it, so that a GPU can stand
// in for one with less shared memory: the tiles chosen and the launches refused are that GPU's.
// Every GPU the kernels run on offers at least 48 KB (what a block gets without opting in), so
// the variable cannot go below that; a value that is not a number of KB is ignored.
inline cudaError_t max_smem_per_block(int* bytes) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  static const int cap_bytes = [] {
    const char* text = std::getenv("FLASH_CUDA_SMEM_LIMIT_KB");
    if (text == nullptr) return INT_MAX;
    char* end = nullptr;
    const long kb = std::strtol(text, &end, 10);
    if (end == text || *end != '\0' || kb <= 0) return INT_MAX;
    return static_cast<int>(std::clamp(kb, 48L, 1L << 20) * 1024);
  }();
  *bytes = std::min(*bytes, cap_bytes);
  return err;
}

// The current device's SM count (the size of a persistent grid).
inline cudaError_t sm_count(int* count) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
  return err;
}

template <class Params> cudaError_t launch_overlapped(void (*kernel)(Params), dim3 grid,
                                                      int threads, int smem_bytes,
                                                      cudaStream_t stream, const Params& params);

// `overlap`: through launch_overlapped (the kernel calls pdl_wait first).
template <class Params> cudaError_t launch_with_smem(void (*kernel)(Params), dim3 grid, int threads,
                                                     int smem_bytes, cudaStream_t stream,
                                                     const Params& params, bool overlap = false) {
  // Past 48 KB a kernel must opt in to more dynamic shared memory; past the (possibly lowered)
  // limit the opt-in fails the way it does on a GPU that has less.
  int limit = 0;
  cudaError_t err = max_smem_per_block(&limit);
  if (err != cudaSuccess) return err;
  if (smem_bytes > limit) return cudaErrorInvalidValue;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (err != cudaSuccess) return err;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;  // nothing to do
  if (overlap) return launch_overlapped(kernel, grid, threads, smem_bytes, stream, params);
  kernel<<<grid, threads, smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

// Whether the device runs `kernel` from code compiled for `arch` (e.g. 90) or later.  Tile
// tables are picked by this, not by the device: a build for sm80 only runs on an sm90 GPU
// through its compute_80 PTX, where the sm90 table's kernels are empty.  The PTX version of a
// kernel's loaded image is the __CUDA_ARCH__ it was compiled for.  It is asked of the driver once
// per kernel and device (cudaFuncGetAttributes costs a launch a few microseconds of host time)
// and kept; an error is returned each time and not kept.
inline cudaError_t ptx_version_of(const void* kernel, int* version) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int> known;
  const std::pair<const void*, int> key(kernel, device);
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = known.find(key);
    if (it != known.end()) {
      *version = it->second;
      return cudaSuccess;
    }
  }
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  *version = attr.ptxVersion;
  std::lock_guard<std::mutex> lock(mutex);
  known.emplace(key, *version);
  return cudaSuccess;
}

template <class Params> cudaError_t runs_code_for(void (*kernel)(Params), int arch, bool* yes) {
  int version = 0;
  const cudaError_t err = ptx_version_of(reinterpret_cast<const void*>(kernel), &version);
  *yes = err == cudaSuccess && version >= arch;
  return err;
}

// Launches `kernel` allowed to start its blocks while the stream's previous kernel finishes
// (programmatic dependent launch), where the code the device runs is sm90+ and so waits for
// that kernel in pdl_wait before it reads anything the kernel writes (a build for sm80 only
// runs compute_80 PTX on an sm90 GPU: no wait there, so no overlap).  Every kernel launched
// this way calls pdl_wait before it exits, so that its completion still implies its
// predecessors'.  FLASH_CUDA_NO_OVERLAP=1 (read at every launch) launches plainly, for
// comparisons.
template <class Params>
cudaError_t launch_overlapped(void (*kernel)(Params), dim3 grid, int threads, int smem_bytes,
                              cudaStream_t stream, const Params& params) {
  const char* text = std::getenv("FLASH_CUDA_NO_OVERLAP");
  const bool off = text != nullptr && text[0] == '1' && text[1] == '\0';
  bool overlap = false;
  cudaError_t err = off ? cudaSuccess : runs_code_for(kernel, 90, &overlap);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  return cudaLaunchKernelEx(&config, kernel, params);
}

}  // namespace flash_cuda
