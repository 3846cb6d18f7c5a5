// The CUDA kernel of torch.ops.flash_cuda.fwd_kvcache: the op rules (check_kvcache_op, the C++
// side of flash_cuda/_checks.py's, Note [Checks in two places] in attention_cuda.cpp), then
// tensors -> KvcacheParams -> dispatch.  In C++, not Python: a decode step is short enough
// that the host time of every call shows.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>

#include "dispatch/dispatch.h"
#include "ops/kvcache_checks.h"

namespace flash_cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

bool rows_aligned(const Tensor& t) {
  if (t.stride(-1) != 1) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.stride(i) % 8 != 0) return false;
  }
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

const int* index_ptr(const OptTensor& t, const Tensor& q, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->device() == q.device() &&
                        t->is_contiguous(),
                    "fwd_kvcache: ", name, " must be a contiguous int32 tensor on q's device");
  return t->data_ptr<int>();
}

TensorRef ref4(const Tensor& t, bool packed) {  // (batch, rows, heads, d) or packed (rows, ...)
  TensorRef r;
  r.ptr = t.data_ptr();
  r.batch_stride = packed ? 0 : t.stride(0);
  r.row_stride = t.stride(-3);
  r.head_stride = t.stride(-2);
  return r;
}

int device_arch(const Tensor& t) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, t.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, t.get_device()));
  return major * 10 + minor;
}

Tensor fwd_kvcache_cuda(const Tensor& q_in, Tensor& k_cache, Tensor& v_cache,
                        const OptTensor& k_in, const OptTensor& v_in,
                        const OptTensor& rotary_cos, const OptTensor& rotary_sin,
                        const OptTensor& cache_seqlens, const OptTensor& cache_batch_idx,
                        const OptTensor& cache_leftpad, const OptTensor& page_table_in,
                        const OptTensor& cu_seqlens_q, const OptTensor& cu_seqlens_k_new,
                        std::optional<int64_t> max_seqlen_q, const OptTensor& rotary_seqlens,
                        double softmax_scale, bool causal, int64_t window_left,
                        int64_t window_right, bool rotary_interleaved, int64_t num_splits,
                        Tensor& out) {
  const int64_t batch = check_kvcache_op(
      q_in, k_cache, v_cache, k_in, v_in, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
      cache_leftpad, page_table_in, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_seqlens,
      softmax_scale, window_left, window_right, out);
  const c10::cuda::CUDAGuard guard(q_in.device());
  // The caches are written in place and read in 16-byte chunks: they cannot be copied.
  TORCH_CHECK_VALUE(rows_aligned(k_cache) && rows_aligned(v_cache) &&
                        k_cache.strides() == v_cache.strides(),
                    "flash_attn_with_kvcache on CUDA: k_cache and v_cache must have the same "
                    "strides, a contiguous last dimension, 16-byte aligned rows (strides "
                    "multiples of 8 elements) and a 16-byte aligned start");
  const bool varlen_q = cu_seqlens_q.has_value();
  const bool paged = page_table_in.has_value();
  const Tensor q = rows_aligned(q_in) ? q_in : q_in.clone(at::MemoryFormat::Contiguous);
  const Tensor o = rows_aligned(out) ? out : at::empty(q.sizes(), q.options());
  const int64_t heads_q = q.size(-2), heads_kv = k_cache.size(2), head_dim = q.size(-1);
  const int64_t seqlen_q = varlen_q ? max_seqlen_q.value_or(q.size(0)) : q.size(1);
  Tensor lse = varlen_q
                   ? at::full({heads_q, q.size(0)}, -std::numeric_limits<float>::infinity(),
                              q.options().dtype(at::kFloat))
                   : at::empty({batch, heads_q, q.size(1)}, q.options().dtype(at::kFloat));
  if (varlen_q) o.zero_();  // packed rows outside every sequence are never visited

  KvcacheParams kp;
  FwdParams& p = kp.fwd;
  p.q = ref4(q, varlen_q);
  p.o = ref4(o, varlen_q);
  p.lse.ptr = lse.data_ptr<float>();
  p.lse.batch_stride = varlen_q ? 0 : lse.stride(0);
  p.lse.head_stride = varlen_q ? lse.stride(0) : lse.stride(1);
  p.k = ref4(k_cache, false);
  p.v = ref4(v_cache, false);
  p.seq_q.cu_seqlens = index_ptr(cu_seqlens_q, q, "cu_seqlens_q");
  p.seq_q.seqlen = static_cast<int>(seqlen_q);
  p.seq_q.total_rows = static_cast<int>(varlen_q ? q.size(0) : 0);
  p.batch = static_cast<int>(batch);
  p.heads_q = static_cast<int>(heads_q);
  p.heads_kv = static_cast<int>(heads_kv);
  p.head_dim = static_cast<int>(head_dim);
  p.softmax_scale = static_cast<float>(softmax_scale);
  KvCacheArgs& kv = p.kv;
  kv.cache_seqlens = index_ptr(cache_seqlens, q, "cache_seqlens");
  kv.cu_seqlens_new = index_ptr(cu_seqlens_k_new, q, "cu_seqlens_k_new");
  kv.leftpad = index_ptr(cache_leftpad, q, "cache_leftpad");
  kv.batch_idx = index_ptr(cache_batch_idx, q, "cache_batch_idx");
  Tensor page_table;
  if (paged) {
    page_table = page_table_in->contiguous();
    kv.page_table = index_ptr(page_table, q, "page_table");
    kv.pages_per_seq = static_cast<int>(page_table.size(1));
    kv.page_size = static_cast<int>(k_cache.size(1));
    kv.capacity = static_cast<int>(page_table.size(1) * k_cache.size(1));
  } else {
    kv.capacity = static_cast<int>(k_cache.size(1));
  }
  kv.cache_dim0 = static_cast<int>(k_cache.size(0));
  p.seq_k.seqlen = kv.capacity;
  // A window at least as long as every key and query row is no window (keeps the kernels' int
  // arithmetic, row + diag - window, far from overflow).
  const int64_t rows = int64_t(kv.capacity) + seqlen_q + 1;
  auto window = [&](int64_t w) { return w < 0 || w >= rows ? -1 : static_cast<int>(w); };
  p.window_left = window(window_left);
  p.window_right = causal ? 0 : window(window_right);
  p.split.num_splits = static_cast<int>(num_splits);

  Tensor k_new, v_new;
  if (k_in.has_value()) {
    const bool packed = cu_seqlens_k_new.has_value();
    k_new = rows_aligned(*k_in) ? *k_in : k_in->clone(at::MemoryFormat::Contiguous);
    v_new = rows_aligned(*v_in) ? *v_in : v_in->clone(at::MemoryFormat::Contiguous);
    kp.k_new = ref4(k_new, packed);
    kp.v_new = ref4(v_new, packed);
    kv.new_rows = packed ? 0 : static_cast<int>(k_new.size(1));
    kp.k_new_total_rows = packed ? static_cast<int>(k_new.size(0)) : 0;
  }
  Tensor cos, sin;
  if (rotary_cos.has_value()) {
    // The kernels read float32 tables or q's own type in place, rows at any stride; other
    // tables are converted here (a copy of the whole table on every call).
    cos = *rotary_cos;
    sin = *rotary_sin;
    const bool own_type =
        cos.scalar_type() == at::kFloat || cos.scalar_type() == q.scalar_type();
    const bool in_place = own_type && sin.scalar_type() == cos.scalar_type() &&
                          cos.stride(1) == 1 && sin.stride(1) == 1 &&
                          cos.stride(0) == sin.stride(0);
    if (!in_place) {
      cos = cos.to(at::kFloat).contiguous();
      sin = sin.to(at::kFloat).contiguous();
    }
    kp.rotary.cos = cos.data_ptr();
    kp.rotary.sin = sin.data_ptr();
    kp.rotary.row_stride = cos.stride(0);
    kp.rotary.float_table = cos.scalar_type() == at::kFloat;
    kp.rotary.rows = static_cast<int>(cos.size(0));
    kp.rotary.rotary_dim = static_cast<int>(2 * cos.size(1));
    kp.rotary.interleaved = rotary_interleaved;
    kp.rotary.start = index_ptr(rotary_seqlens, q, "rotary_seqlens");
    kp.rotary.advance = causal || window_left >= 0 || window_right >= 0;
  }

  const DType dtype = q.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  const auto kernel = find_fwd_kvcache(device_arch(q), dtype, kp);
  TORCH_CHECK_NOT_IMPLEMENTED(kernel.found(), kernel.error);
  const size_t bytes = kernel.launcher.workspace_bytes(kp);
  Tensor workspace;
  if (bytes > 0) workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
  const cudaError_t err = kernel.launcher.run(kp, bytes ? workspace.data_ptr() : nullptr,
                                              c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_cuda: the KV-cache kernels for head dim ",
              kernel.head_dim, " failed to launch: ", cudaGetErrorString(err));
  if (!o.is_same(out)) out.copy_(o);
  return lse;
}

int64_t kvcache_num_splits(const Tensor& cache_seqlens, int64_t batch, int64_t seqlen_q,
                           bool varlen_q, int64_t heads_q, int64_t heads_kv, int64_t head_dim,
                           int64_t capacity, at::ScalarType dtype, int64_t window_left,
                           int64_t num_splits, int64_t page_size, bool leftpad) {
  const c10::cuda::CUDAGuard guard(cache_seqlens.device());
  auto as_int = [](int64_t v, const char* name) {
    TORCH_CHECK_VALUE(v >= 0 && v <= std::numeric_limits<int>::max(), "get_scheduler_metadata: ",
                      name, " must be between 0 and 2^31 - 1; got ", v);
    return static_cast<int>(v);
  };
  KvcacheParams kp;
  FwdParams& p = kp.fwd;
  p.batch = as_int(batch, "batch_size");
  p.seq_q.seqlen = as_int(seqlen_q, "max_seqlen_q");
  // Only whether q is packed, the cache paged (and its page size: the Hopper family reads
  // pages of whole key tiles in place) or left-padded matters here: markers, never read.
  static int marker = 0;
  p.seq_q.cu_seqlens = varlen_q ? &marker : nullptr;
  p.kv.page_table = page_size > 0 ? &marker : nullptr;
  p.kv.page_size = as_int(page_size, "page_size");
  p.kv.leftpad = leftpad ? &marker : nullptr;
  p.kv.cache_dim0 = p.batch;  // a row (or pages) for every sequence
  p.heads_q = as_int(heads_q, "num_heads_q");
  p.heads_kv = as_int(heads_kv, "num_heads_kv");
  p.head_dim = as_int(head_dim, "headdim");
  p.lse.head_stride = varlen_q ? 0 : p.seq_q.seqlen;  // the op's lse: (batch, heads, seqlen_q)
  p.kv.capacity = as_int(capacity, "max_seqlen_k");
  // The op's rule: a window at least as long as every key and query row is no window (and
  // decides whether a decode step packs its GQA group, so the kernel and its split count).
  const int64_t rows = int64_t(p.kv.capacity) + p.seq_q.seqlen + 1;
  p.window_left = window_left < 0 || window_left >= rows ? -1 : static_cast<int>(window_left);
  p.split.num_splits = as_int(num_splits, "num_splits");
  const DType kernel_dtype = dtype == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf,
                    "get_scheduler_metadata: qkv_dtype must be torch.float16 or torch.bfloat16");
  const auto kernel = find_fwd_kvcache(device_arch(cache_seqlens), kernel_dtype, kp);
  TORCH_CHECK_NOT_IMPLEMENTED(kernel.found(), kernel.error);
  return std::max(1, kernel.launcher.num_splits(kp));
}

// flash_attn_combine on CUDA: out_partial (splits, batch, seqlen, heads, d) or (splits, total,
// heads, d), float32, rows 16-byte aligned; lse_partial its shape without d; out 16-bit.  The
// kernel writes lse as (batch, heads, seqlen); it comes back (batch, seqlen, heads) (or
// (total, heads)).
Tensor combine_cuda(const Tensor& out_partial, const Tensor& lse_partial, Tensor& out) {
  const c10::cuda::CUDAGuard guard(out_partial.device());
  const bool packed = out_partial.dim() == 4;
  TORCH_CHECK_VALUE(out_partial.scalar_type() == at::kFloat && lse_partial.scalar_type() == at::kFloat &&
                        (out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) &&
                        (out_partial.dim() == 4 || out_partial.dim() == 5) &&
                        lse_partial.dim() == out_partial.dim() - 1 &&
                        out.dim() == out_partial.dim() - 1,
                    "_combine_cuda: float32 partials of 4 or 5 dims and a 16-bit out");
  const int64_t d = out_partial.size(-1);
  bool aligned = d % 4 == 0 && out_partial.stride(-1) == 1 && out.stride(-1) == 1 &&
                 reinterpret_cast<uintptr_t>(out_partial.data_ptr()) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0;
  for (int64_t i = 0; i + 1 < out_partial.dim(); ++i) aligned &= out_partial.stride(i) % 4 == 0;
  for (int64_t i = 0; i + 1 < out.dim(); ++i) aligned &= out.stride(i) % 4 == 0;
  TORCH_CHECK_VALUE(aligned, "_combine_cuda: rows must be 16-byte aligned");
  TORCH_CHECK_VALUE(d <= kCombineMaxHeadDim, "_combine_cuda: the head dim must be at most ",
                    kCombineMaxHeadDim, "; got ", d);
  const int64_t splits = out_partial.size(0);
  const int64_t batch = packed ? 1 : out_partial.size(1);
  const int64_t seqlen = out_partial.size(-3), heads = out_partial.size(-2);
  Tensor lse = packed ? at::empty({heads, seqlen}, out_partial.options())
                      : at::empty({batch, heads, seqlen}, out_partial.options());
  CombineArgs a;
  SplitArgs& s = a.split;
  s.num_splits = static_cast<int>(splits);
  s.o = out_partial.data_ptr<float>();
  s.o_split_stride = out_partial.stride(0);
  s.o_batch_stride = packed ? 0 : out_partial.stride(1);
  s.o_row_stride = out_partial.stride(-3);
  s.o_head_stride = out_partial.stride(-2);
  s.lse = lse_partial.data_ptr<float>();
  s.lse_split_stride = lse_partial.stride(0);
  s.lse_batch_stride = packed ? 0 : lse_partial.stride(1);
  s.lse_row_stride = lse_partial.stride(-2);
  s.lse_head_stride = lse_partial.stride(-1);
  a.o.ptr = out.data_ptr();
  a.o.batch_stride = packed ? 0 : out.stride(0);
  a.o.row_stride = out.stride(-3);
  a.o.head_stride = out.stride(-2);
  a.lse.ptr = lse.data_ptr<float>();
  a.lse.batch_stride = packed ? 0 : lse.stride(0);
  a.lse.head_stride = packed ? lse.stride(0) : lse.stride(1);
  a.seq_q.seqlen = static_cast<int>(seqlen);
  a.heads = static_cast<int>(heads);
  a.head_dim = static_cast<int>(d);
  const DType dtype = out.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  const cudaError_t err = run_combine(a, static_cast<int>(batch), dtype,
                                      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "flash_cuda: the combine kernel failed to launch: ",
              cudaGetErrorString(err));
  // (batch, seqlen, heads), contiguous like the CPU and fake kernels' (a copy of lse-sized rows).
  return (packed ? lse.t() : lse.transpose(1, 2)).contiguous();
}

}  // namespace
}  // namespace flash_cuda

TORCH_LIBRARY_IMPL(flash_cuda, CUDA, m) {
  m.impl("_combine_cuda", &flash_cuda::combine_cuda);
  m.impl("fwd_kvcache", &flash_cuda::fwd_kvcache_cuda);
  m.impl("_kvcache_num_splits", &flash_cuda::kvcache_num_splits);
}
