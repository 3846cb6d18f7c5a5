// Host-side launch of the portable forward kernel for one (dtype, head dim): grid shape, shared
// memory opt-in, launch-error check.  Instantiated once per manifest entry.
#pragma once

#include <cuda_runtime.h>

#include "common/launch_api.h"
#include "sm80/fwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Kernel = FwdKernel<ElementTag, kHeadDim>;
  auto* kernel = &fwd_kernel<Kernel>;
  constexpr int kSmem = Kernel::kSmemBytes;
  // Past 48 KB a kernel must opt in to more dynamic shared memory.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.seq_q.seqlen + Kernel::kBlockM - 1) / Kernel::kBlockM, params.heads_q,
                  params.batch);
  if (grid.x == 0 || grid.z == 0) return cudaSuccess;
  kernel<<<grid, Kernel::kThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash_cuda::sm80
