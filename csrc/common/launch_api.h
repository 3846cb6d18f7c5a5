// Declarations of every kernel family's launchers.  The generated translation units instantiate
// them and the dispatcher takes their addresses; this header is plain C++ (no device code).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "common/params.h"

namespace flash_cuda {

// Element tags: the dispatcher names dtypes without seeing CUDA's half types.
struct half_t;
struct bfloat16_t;

// Every family declares, per op, a launcher, whether it takes a problem (`fwd_supports`: a
// problem it does not take runs on the portable family) and, where the op needs scratch device
// memory, its size: the op layer allocates `bwd_workspace_bytes(params)` bytes (aligned as torch's allocator
// aligns, to 512) and hands them to run_bwd, which lays them out and runs the op's pre- and
// post-kernels itself.  The op layer learns no family's layout.
// flash_attn_combine's kernel (common/combine.cu): batch x (seq_q rows, heads) rows of split
// partials merged into a 16-bit out and a float32 lse; rows of at most kCombineMaxHeadDim
// values, a multiple of 4, and at most kCombineMaxRows (seq_q rows x heads) per sequence, its
// grid's x (cudaErrorInvalidConfiguration otherwise).
constexpr int kCombineMaxHeadDim = 256;
constexpr int64_t kCombineMaxRows = 0x7fffffff;
cudaError_t run_combine(const CombineArgs& args, int batch, DType dtype, cudaStream_t stream);

namespace sm80 {
template <class ElementTag, int kHeadDim>
bool fwd_supports(const FwdParams& params);
template <class ElementTag, int kHeadDim>
size_t fwd_workspace_bytes(const FwdParams& params);
template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, void* workspace, cudaStream_t stream);
template <class ElementTag, int kHeadDim>
size_t bwd_workspace_bytes(const BwdParams& params);
template <class ElementTag, int kHeadDim>
cudaError_t run_bwd(const BwdParams& params, void* workspace, cudaStream_t stream);
template <class ElementTag, int kHeadDim>
bool fwd_kvcache_supports(const KvcacheParams& params);
template <class ElementTag, int kHeadDim>
size_t fwd_kvcache_workspace_bytes(const KvcacheParams& params);
template <class ElementTag, int kHeadDim>
cudaError_t run_fwd_kvcache(const KvcacheParams& params, void* workspace, cudaStream_t stream);
template <class ElementTag, int kHeadDim>
int fwd_kvcache_num_splits(const KvcacheParams& params);
// rowsum(dO * O) for every row, written to params.dot_do_o, and the dQ accumulator zeroed;
// dtype chosen at run time.  Part of run_bwd.
cudaError_t run_bwd_preprocess(const BwdParams& params, DType dtype, cudaStream_t stream);
}  // namespace sm80

namespace sm90 {
template <class ElementTag, int kHeadDim>
bool fwd_kvcache_supports(const KvcacheParams& params);
template <class ElementTag, int kHeadDim>
size_t fwd_kvcache_workspace_bytes(const KvcacheParams& params);
template <class ElementTag, int kHeadDim>
cudaError_t run_fwd_kvcache(const KvcacheParams& params, void* workspace, cudaStream_t stream);
template <class ElementTag, int kHeadDim>
int fwd_kvcache_num_splits(const KvcacheParams& params);
template <class ElementTag, int kHeadDim>
bool fwd_supports(const FwdParams& params);
template <class ElementTag, int kHeadDim>
size_t fwd_workspace_bytes(const FwdParams& params);
template <class ElementTag, int kHeadDim>
cudaError_t run_fwd(const FwdParams& params, void* workspace, cudaStream_t stream);
}  // namespace sm90

}  // namespace flash_cuda
