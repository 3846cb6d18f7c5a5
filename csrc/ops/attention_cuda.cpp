// The CUDA implementations of torch.ops.flash_cuda.fwd / .bwd (schemas: registration.cpp):
// tensors -> FwdParams / BwdParams -> dispatch.  With registration.cpp, the only code that sees
// at::Tensor.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <string>

#include "dispatch/dispatch.h"
#include "ops/checks.h"

namespace flash_cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Note [Checks in two places]
// The op rules are written twice, here for CUDA tensors and in flash_cuda/_checks.py for the
// CPU and fake kernels, with the same messages (tests run one list of bad inputs through both
// and compare the CUDA kernel's messages with the fake kernel's on CUDA tensors, word for
// word), so that a direct torch.ops call gets the answer the Python API gives.  Rules that need
// tensor values (cu_seqlens ordering, max_seqlen covering it, seqused within its sequence) are
// checked only where values can be read without a device sync: on the CPU.  The CUDA grid's
// limits (heads, batch, 32-bit row counts) hold for CUDA tensors only: the fake kernel checks
// them for fake CUDA tensors, so that a compiled graph fails at trace time, not at run time.

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, bool varlen) {
  TORCH_CHECK_VALUE(k.device() == q.device() && v.device() == q.device(),
                    "q, k, v must be on the same device; got q on ", q.device(), ", k on ",
                    k.device(), ", v on ", v.device(), ".");
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "q, k, v must share one dtype; got q ", dtype_name(q.scalar_type()), ", k ",
                    dtype_name(k.scalar_type()), ", v ", dtype_name(v.scalar_type()), ".");
  check_q_dtype(q);
  check_rank("q", q, varlen);
  check_rank("k", k, varlen);
  check_rank("v", v, varlen);
  const int64_t d = q.size(-1);
  TORCH_CHECK_VALUE(k.size(-1) == d && v.size(-1) == d,
                    "q, k and v must share the head dim (last dimension); got ", d, ", ",
                    k.size(-1), " and ", v.size(-1), ".");
  TORCH_CHECK_VALUE(d % 8 == 0 && d >= 8 && d <= 256,
                    "the head dim of q, k and v (their last dimension) must be a multiple of 8 "
                    "between 8 and 256; got ", d, ". Pad it with zeros up to the next multiple "
                    "of 8 if needed.");
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape; got ",
                    shape(k.sizes()), " and ", shape(v.sizes()), ".");
  const int64_t hq = q.size(-2), hk = k.size(-2);
  TORCH_CHECK_VALUE(hk > 0 && hq % hk == 0, "the number of heads of q (", hq,
                    ") must be a multiple of the number of heads of k and v (", hk,
                    ") (MHA, GQA or MQA).");
  // The grid puts heads in y: CUDA allows 65535.
  TORCH_CHECK_VALUE(hq <= 65535, "the number of heads of q must be at most 65535 on CUDA; got ",
                    hq, ".");
  if (!varlen) {
    TORCH_CHECK_VALUE(k.size(0) == q.size(0),
                      "q, k and v must have the same batch size (dimension 0); got ", q.size(0),
                      " for q and ", k.size(0), " for k and v.");
  }
}

// The kernels copy 16-byte chunks, so each row must start 16-byte aligned.
bool is_aligned(const Tensor& t) {
  if (t.stride(-1) != 1) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if (t.stride(i) % 8 != 0) return false;
  }
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Note [Misaligned inputs]
// A tensor whose last dimension is not contiguous, or whose row strides are not multiples of 8
// elements (say, a slice of a packed buffer at an odd offset), cannot be read with 16-byte
// copies; it is copied once to a contiguous tensor, as FlashAttention-3 does.  Any aligned
// stride pattern is read in place.
Tensor aligned(const Tensor& t) {
  // clone, not contiguous(): a contiguous view at an odd offset must be copied too.
  return is_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Note [Output layout]
// Outputs are laid out like the input they mirror (out and dq like q, dk like k, dv like v) when
// that input's last dimension is contiguous, through empty_like's preserve_format: the same
// strides for a dense tensor (a (batch, heads, seqlen, d) tensor viewed as (batch, seqlen, heads,
// d), as SDPA passes it, gets an out SDPA can view back, as its meta kernels promise), dense
// strides in the same order of dimensions for one with gaps; contiguous when the last dimension
// is not.  The fake kernels (flash_cuda/reference.py output_like) allocate the same way.
Tensor new_like(const Tensor& like, bool zeroed) {
  Tensor t = like.stride(-1) == 1 ? at::empty_like(like) : at::empty(like.sizes(), like.options());
  return zeroed ? t.zero_() : t;
}

TensorRef ref(const Tensor& t, bool varlen) {
  TensorRef r;
  r.ptr = t.data_ptr();
  r.batch_stride = varlen ? 0 : t.stride(0);
  r.row_stride = t.stride(-3);
  r.head_stride = t.stride(-2);
  return r;
}

// lse-shaped statistics: dense (batch, heads, seqlen), varlen (heads, total); rows contiguous.
RowStatsRef stats_ref(const Tensor& t, bool varlen) {
  RowStatsRef r;
  r.ptr = t.data_ptr<float>();
  r.batch_stride = varlen ? 0 : t.stride(0);
  r.head_stride = varlen ? t.stride(0) : t.stride(1);
  return r;
}

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK_VALUE(v >= 0 && v <= std::numeric_limits<int>::max(), what,
                    " must be between 0 and 2^31 - 1 on CUDA; got ", v, ".");
  return static_cast<int>(v);
}

SeqArgs seq_args(const OptTensor& cu_seqlens, const OptTensor& seqused, int64_t seqlen,
                 int64_t total_rows, const char* what) {
  SeqArgs s;
  s.cu_seqlens = cu_seqlens.has_value() ? cu_seqlens->data_ptr<int>() : nullptr;
  s.seqused = seqused.has_value() ? seqused->data_ptr<int>() : nullptr;
  s.seqlen = checked_int(seqlen, what);
  s.total_rows = checked_int(total_rows, "the number of rows of q / k");
  return s;
}

// A window at least as long as every sequence is no window: -1.  Total rows bound every
// sequence, so this is exact without reading cu_seqlens, and keeps the kernels' int arithmetic
// (row + diag - window) far from overflow.
int clamp_window(int64_t window, int64_t rows) { return window >= rows ? -1 : static_cast<int>(window); }

void check_launch(cudaError_t err, const char* direction, int head_dim) {
  TORCH_CHECK(err == cudaSuccess, "flash_cuda: the ", direction, " kernel for head dim ",
              head_dim, " failed to launch: ", cudaGetErrorString(err),
              err == cudaErrorInvalidValue
                  ? " (its tile needs more shared memory per block than this GPU offers; GPUs "
                    "of compute capability 8.6, 8.9 and 12.x have 99 KB)"
                  : "");
}

int device_arch(const Tensor& t) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, t.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, t.get_device()));
  return major * 10 + minor;
}

// Checks the op rules and fills the problem description both directions share.
FwdParams problem(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& cu_q,
                  const OptTensor& cu_k, const OptTensor& used_q, const OptTensor& used_k,
                  int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, bool causal,
                  int64_t window_left, int64_t window_right) {
  const bool varlen = cu_q.has_value();
  TORCH_CHECK_VALUE(cu_k.has_value() == varlen,
                    "cu_seqlens_q and cu_seqlens_k go together: pass both (varlen attention) or "
                    "neither (dense attention).");
  check_qkv(q, k, v, varlen);
  TORCH_CHECK_VALUE(!varlen || (cu_q->dim() == 1 && cu_q->size(0) >= 1),
                    "cu_seqlens_q must be 1-D with batch + 1 >= 1 entries; got shape ",
                    shape(cu_q->sizes()), ".");
  const int64_t batch = varlen ? cu_q->size(0) - 1 : q.size(0);
  // The grid puts batches in z (65535); the block order may fold two heads per slot.
  TORCH_CHECK_VALUE(batch <= 65535 / 2, "the batch size must be at most 32767 on CUDA; got ",
                    batch, ".");
  check_index_tensor(cu_q, "cu_seqlens_q", batch + 1, q);
  check_index_tensor(cu_k, "cu_seqlens_k", batch + 1, q);
  check_index_tensor(used_q, "seqused_q", batch, q);
  check_index_tensor(used_k, "seqused_k", batch, q);
  TORCH_CHECK_VALUE(max_seqlen_q >= 0, "max_seqlen_q must be >= 0; got ", max_seqlen_q, ".");
  TORCH_CHECK_VALUE(max_seqlen_k >= 0, "max_seqlen_k must be >= 0; got ", max_seqlen_k, ".");
  check_window(window_left, window_right);
  check_scale(scale);
  FwdParams p;
  p.batch = static_cast<int>(batch);
  p.heads_q = static_cast<int>(q.size(-2));
  p.heads_kv = static_cast<int>(k.size(-2));
  p.head_dim = static_cast<int>(q.size(-1));
  p.softmax_scale = static_cast<float>(scale);
  const int64_t rows_q = varlen ? q.size(0) : q.size(1);
  const int64_t rows_k = varlen ? k.size(0) : k.size(1);
  p.window_left = clamp_window(window_left, rows_k);
  p.window_right = causal ? 0 : clamp_window(window_right, rows_q);
  p.seq_q = seq_args(cu_q, used_q, varlen ? max_seqlen_q : rows_q, q.size(0), "max_seqlen_q");
  p.seq_k = seq_args(cu_k, used_k, varlen ? max_seqlen_k : rows_k, k.size(0), "max_seqlen_k");
  return p;
}

Tensor new_stats(const Tensor& q, bool varlen, int64_t batch, float fill) {
  auto opts = q.options().dtype(at::kFloat);
  const int64_t heads = q.size(-2);
  return varlen ? at::full({heads, q.size(0)}, fill, opts)
                : at::empty({batch, heads, q.size(1)}, opts);
}

DType kernel_dtype(const Tensor& q) {
  return q.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
}

std::tuple<Tensor, Tensor> fwd_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    const OptTensor& cu_q, const OptTensor& cu_k,
                                    const OptTensor& used_q, const OptTensor& used_k,
                                    int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                    bool causal, int64_t window_left, int64_t window_right,
                                    bool /*deterministic: only the backward's concern*/) {
  const bool varlen = cu_q.has_value();
  FwdParams p = problem(q_in, k_in, v_in, cu_q, cu_k, used_q, used_k, max_seqlen_q, max_seqlen_k,
                        scale, causal, window_left, window_right);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);

  // Packed rows outside every sequence are never visited: zero / -inf them up front.
  Tensor out = new_like(q_in, /*zeroed=*/varlen);
  Tensor lse = new_stats(q, varlen, p.batch, -std::numeric_limits<float>::infinity());
  p.q = ref(q, varlen);
  p.k = ref(k, varlen);
  p.v = ref(v, varlen);
  p.o = ref(out, varlen);
  p.lse = stats_ref(lse, varlen);
  // Dispatch sees the whole problem, pointers and strides included (a family may decline it).
  const auto kernel = find_fwd(device_arch(q_in), kernel_dtype(q_in), p);
  TORCH_CHECK_NOT_IMPLEMENTED(kernel.found(), kernel.error);
  // The launcher's scratch memory (the sm90 tile counter); none for the portable family.
  const size_t workspace_bytes = kernel.launcher.workspace_bytes(p);
  Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, q.options().dtype(at::kByte));
  }
  check_launch(kernel.launcher.run(p, workspace_bytes ? workspace.data_ptr() : nullptr,
                                   c10::cuda::getCurrentCUDAStream()), "forward",
               kernel.head_dim);
  return {out, lse};
}

void check_like_q(const char* name, const Tensor& t, const Tensor& q) {
  TORCH_CHECK_VALUE(t.sizes() == q.sizes() && t.scalar_type() == q.scalar_type() &&
                        t.device() == q.device(),
                    name, " must have q's shape ", shape(q.sizes()), ", dtype ",
                    dtype_name(q.scalar_type()), " and device ", q.device(), "; got ",
                    shape(t.sizes()), ", ", dtype_name(t.scalar_type()), " on ", t.device(), ".");
}

// Gradients of a kv head are the sums over its query heads (heads h*r .. h*r + r - 1), written
// into `out` (laid out like k or v).
void sum_over_group(const Tensor& expanded, Tensor& out) {
  auto grouped = expanded.sizes().vec();
  const int64_t heads_kv = out.size(-2);
  grouped[grouped.size() - 2] = heads_kv;
  grouped.insert(grouped.end() - 1, expanded.size(-2) / heads_kv);
  at::sum_out(out, expanded.view(grouped), {-2});
}

std::tuple<Tensor, Tensor, Tensor> bwd_cuda(
    const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& out_in, const Tensor& lse_in, const OptTensor& cu_q, const OptTensor& cu_k,
    const OptTensor& used_q, const OptTensor& used_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double scale, bool causal, int64_t window_left, int64_t window_right, bool deterministic) {
  const bool varlen = cu_q.has_value();
  FwdParams f = problem(q_in, k_in, v_in, cu_q, cu_k, used_q, used_k, max_seqlen_q, max_seqlen_k,
                        scale, causal, window_left, window_right);
  check_like_q("dout", dout_in, q_in);
  check_like_q("out", out_in, q_in);
  const auto lse_shape = varlen ? std::vector<int64_t>{q_in.size(-2), q_in.size(0)}
                                : std::vector<int64_t>{q_in.size(0), q_in.size(-2), q_in.size(1)};
  TORCH_CHECK_VALUE(lse_in.sizes() == at::IntArrayRef(lse_shape) &&
                        lse_in.scalar_type() == at::kFloat && lse_in.device() == q_in.device(),
                    "softmax_lse must be the forward's: float32 of shape ", shape(lse_shape),
                    " on ", q_in.device(), "; got ", dtype_name(lse_in.scalar_type()),
                    " of shape ", shape(lse_in.sizes()), " on ", lse_in.device(), ".");
  TORCH_CHECK_NOT_IMPLEMENTED(!deterministic,
                              "deterministic=True is not supported by the CUDA backward yet: its "
                              "dq accumulation uses atomics; pass deterministic=False");
  // torch.use_deterministic_algorithms(True) raises here (warns with warn_only=True).
  at::globalContext().alertNotDeterministic("flash_cuda::bwd (its dq accumulation uses atomics)");
  const c10::cuda::CUDAGuard guard(q_in.device());
  BwdParams shape_only;  // the problem find_bwd weighs; the launch's params come below
  shape_only.fwd = f;
  const auto kernel = find_bwd(device_arch(q_in), kernel_dtype(q_in), shape_only);
  TORCH_CHECK_NOT_IMPLEMENTED(kernel.found(), kernel.error);
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  const Tensor dout = aligned(dout_in), out = aligned(out_in);
  const Tensor lse = lse_in.contiguous();

  const int64_t heads_q = q.size(-2);
  const bool grouped = heads_q != k.size(-2);
  auto expanded_sizes = k.sizes().vec();
  expanded_sizes[expanded_sizes.size() - 2] = heads_q;
  // Varlen rows past the last sequence are never visited, so those buffers start zeroed.
  Tensor dq = new_like(q_in, varlen);
  Tensor dk = new_like(k_in, varlen && !grouped);
  Tensor dv = new_like(v_in, varlen && !grouped);
  auto expanded = [&](const Tensor& like) {
    return varlen ? at::zeros(expanded_sizes, like.options()) : at::empty(expanded_sizes, like.options());
  };
  Tensor dk_expanded = grouped ? expanded(k) : dk;
  Tensor dv_expanded = grouped ? expanded(v) : dv;
  f.q = ref(q, varlen);
  f.k = ref(k, varlen);
  f.v = ref(v, varlen);
  f.o = ref(out, varlen);
  f.lse = stats_ref(lse, varlen);
  BwdParams p;
  p.fwd = f;
  p.dout = ref(dout, varlen);
  p.dq = ref(dq, varlen);
  p.dk = ref(dk_expanded, varlen);
  p.dv = ref(dv_expanded, varlen);
  p.total_rows_q = varlen ? q.size(0) : q.size(0) * q.size(1);
  // The family's scratch memory (its dQ accumulator, rowsum(dO * O)), laid out by its launcher.
  Tensor workspace = at::empty({static_cast<int64_t>(kernel.launcher.workspace_bytes(p))},
                               q.options().dtype(at::kByte));
  check_launch(kernel.launcher.run(p, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               "backward", kernel.head_dim);
  if (grouped) {
    sum_over_group(dk_expanded, dk);
    sum_over_group(dv_expanded, dv);
  }
  return {dq, dk, dv};
}

}  // namespace
}  // namespace flash_cuda

TORCH_LIBRARY_IMPL(flash_cuda, CUDA, m) {
  m.impl("fwd", &flash_cuda::fwd_cuda);
  m.impl("bwd", &flash_cuda::bwd_cuda);
}
