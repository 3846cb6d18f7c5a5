// Host-side launch of the portable backward kernel for one (dtype, head dim).  The caller has
// zeroed dq_accum and run the preprocess kernel (rowsum(dO * O)) on the same stream.
#pragma once

#include <cuda_runtime.h>

#include "common/launch_api.h"
#include "sm80/bwd_kernel.cuh"

namespace flash_cuda::sm80 {

template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, cudaStream_t stream) {
  using Kernel = BwdKernel<ElementTag, kHeadDim>;
  auto* kernel = &bwd_kernel<Kernel>;
  constexpr int kSmem = Kernel::kSmemBytes;
  // Past 48 KB a kernel must opt in to more dynamic shared memory.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid((params.fwd.seq_k.seqlen + Kernel::kBlockN - 1) / Kernel::kBlockN,
                  params.fwd.heads_q, params.fwd.batch * Kernel::kSlices);
  if (grid.x == 0 || grid.z == 0) return cudaSuccess;
  kernel<<<grid, Kernel::kThreads, kSmem, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flash_cuda::sm80
