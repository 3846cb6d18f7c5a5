// The combine kernel's one launcher for every family (split-KV partials -> out and lse in a
// 16-bit dtype): the KV-cache launchers call combine_kernel themselves; this is the entry point
// of flash_attn_combine on CUDA (csrc/ops/kvcache_cuda.cpp).
#include "common/combine.cuh"
#include "common/launch_api.h"

namespace flash_cuda {

cudaError_t run_combine(const CombineArgs& args, int batch, DType dtype, cudaStream_t stream) {
  const int64_t items = int64_t(args.seq_q.seqlen) * args.heads;
  if (items == 0 || batch == 0) return cudaSuccess;
  if (batch > 65535 || items > kCombineMaxRows || args.split.num_splits < 1 ||
      args.split.num_splits > kCombineMaxSplits || args.head_dim % 4 != 0 ||
      args.head_dim > kCombineMaxHeadDim) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid = combine_grid(items, batch);
  if (dtype == DType::kBFloat16) {
    combine_kernel<__nv_bfloat16><<<grid, kCombineWarps * 32, 0, stream>>>(args);
  } else {
    combine_kernel<__half><<<grid, kCombineWarps * 32, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

}  // namespace flash_cuda
