// Reductions over one accumulator row.  In both families' MMA fragments (mma.sync m16n8 and wgmma
// m64nN, fp32 accumulators) the four lanes of a quad (lane / 4 equal) hold the columns of the same
// rows, so a row's maximum or sum is the thread's own, then two butterfly shuffles.
#pragma once

namespace flash_cuda {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

}  // namespace flash_cuda
