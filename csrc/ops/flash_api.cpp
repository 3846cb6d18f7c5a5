// The torch-facing op layer: the schemas of torch.ops.flash_cuda.*, their CUDA implementations
// (tensors -> FwdParams / BwdParams -> dispatch) and the flash_cuda._C module.  It is the only
// code that sees at::Tensor; the CPU and fake implementations are registered from Python.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>

#include "dispatch/dispatch.h"

namespace flash_cuda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Note [Numbers in messages]
// Messages format numbers with std::to_string rather than by streaming them into c10::str: with
// one toolchain we test on, streaming an integer from this extension's inline code crashed the
// process instead of raising the error, while strings were fine.
std::string num(int64_t v) { return std::to_string(v); }

std::string shape(at::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + num(sizes[i]);
  return out + (sizes.size() == 1 ? ",)" : ")");
}

// Note [Checks in two places]
// The Python API validates every argument with messages that name it; these checks repeat the
// ones a direct torch.ops call could violate in a way that would crash or corrupt memory.
void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, bool varlen) {
  const int64_t rank = varlen ? 3 : 4;
  TORCH_CHECK_VALUE(q.dim() == rank && k.dim() == rank && v.dim() == rank, "q, k and v must be ",
                    num(rank), "-D (", varlen ? "total, heads, head_dim" : "batch, seqlen, heads, head_dim",
                    "); got ", num(q.dim()), "-D, ", num(k.dim()), "-D and ", num(v.dim()), "-D");
  TORCH_CHECK_VALUE(q.is_cuda() && k.device() == q.device() && v.device() == q.device(),
                    "q, k and v must be on the same CUDA device");
  TORCH_CHECK_VALUE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                    "q must be float16 or bfloat16 on CUDA; got ", c10::toString(q.scalar_type()));
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                    "q, k and v must have the same dtype");
  TORCH_CHECK_VALUE(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
                    "q, k and v must be contiguous in their last dimension");
  const int64_t d = q.size(-1);
  TORCH_CHECK_VALUE(k.size(-1) == d && v.size(-1) == d, "q, k and v must share the head dim");
  TORCH_CHECK_VALUE(d % 8 == 0 && d > 0 && d <= 256,
                    "head dim must be a multiple of 8 between 8 and 256; got ", num(d));
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have the same shape");
  const int64_t hq = q.size(-2), hk = k.size(-2);
  TORCH_CHECK_VALUE(hq > 0 && hq <= 65535, "heads of q must be between 1 and 65535; got ", num(hq));
  TORCH_CHECK_VALUE(hk > 0 && hq % hk == 0, "heads of q (", num(hq),
                    ") must be a multiple of heads of k and v (", num(hk), ")");
  if (!varlen) {
    TORCH_CHECK_VALUE(k.size(0) == q.size(0), "q, k and v must have the same batch size");
  }
}

void check_seq_tensor(const OptTensor& t, const char* name, int64_t expected_len,
                      const Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kInt, name, " must be int32; got ", c10::toString(t->scalar_type()));
  TORCH_CHECK_VALUE(t->device() == q.device(), name, " must be on the same device as q");
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == expected_len, name, " must have shape (",
                    num(expected_len), ",); got ", shape(t->sizes()));
  TORCH_CHECK_VALUE(t->is_contiguous(), name, " must be contiguous (it is read as a plain array)");
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
// A tensor whose row strides are not multiples of 8 elements (say, a slice of a packed buffer
// at an odd offset) cannot be read with 16-byte copies; it is copied once to a contiguous
// tensor.  Any aligned stride pattern is read in place.
Tensor aligned(const Tensor& t) {
  // clone, not contiguous(): a contiguous view at an odd offset must be copied too.
  return is_aligned(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

TensorRef ref(const Tensor& t, bool varlen) {
  TensorRef r;
  r.ptr = t.data_ptr();
  r.batch_stride = varlen ? 0 : t.stride(0);
  r.row_stride = t.stride(-3);
  r.head_stride = t.stride(-2);
  return r;
}

// lse-shaped statistics: dense (batch, heads, seqlen), varlen (heads, total).
RowStatsRef stats_ref(const Tensor& t, bool varlen) {
  RowStatsRef r;
  r.ptr = t.data_ptr<float>();
  r.batch_stride = varlen ? 0 : t.stride(0);
  r.head_stride = varlen ? t.stride(0) : t.stride(1);
  return r;
}

int checked_int(int64_t v, const char* what) {
  TORCH_CHECK_VALUE(v >= 0 && v <= std::numeric_limits<int>::max(), what,
                    " must be between 0 and 2^31 - 1; got ", num(v));
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
              num(head_dim), " failed to launch: ", cudaGetErrorString(err),
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

// Fills the problem description shared by both directions; returns the aligned q, k, v.
FwdParams problem(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& cu_q,
                  const OptTensor& cu_k, const OptTensor& used_q, const OptTensor& used_k,
                  int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, bool causal,
                  int64_t window_left, int64_t window_right) {
  const bool varlen = cu_q.has_value();
  TORCH_CHECK_VALUE(cu_k.has_value() == varlen, "cu_seqlens_q and cu_seqlens_k go together");
  TORCH_CHECK_VALUE(!varlen || (cu_q->dim() == 1 && cu_q->size(0) >= 1),
                    "cu_seqlens_q must be 1-D with batch + 1 >= 1 entries");
  check_qkv(q, k, v, varlen);
  const int64_t batch = varlen ? cu_q->size(0) - 1 : q.size(0);
  TORCH_CHECK_VALUE(batch >= 0 && batch <= 65535 / 2, "batch must be at most 32767; got ", num(batch));
  check_seq_tensor(cu_q, "cu_seqlens_q", batch + 1, q);
  check_seq_tensor(cu_k, "cu_seqlens_k", batch + 1, q);
  check_seq_tensor(used_q, "seqused_q", batch, q);
  check_seq_tensor(used_k, "seqused_k", batch, q);
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "window_size entries must be >= -1 (-1 means unbounded)");
  // The kernels take scale * log2(e) in float32 (flash_cuda/_checks.py: SCALE_MIN, SCALE_MAX).
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale >= 1e-30 && scale <= 1e30,
                    "softmax_scale must be a finite number > 0, within [1e-30, 1e+30]; got ",
                    scale);
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

std::tuple<Tensor, Tensor> fwd_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    const OptTensor& cu_q, const OptTensor& cu_k,
                                    const OptTensor& used_q, const OptTensor& used_k,
                                    int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
                                    bool causal, int64_t window_left, int64_t window_right) {
  const bool varlen = cu_q.has_value();
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  FwdParams p = problem(q, k, v, cu_q, cu_k, used_q, used_k, max_seqlen_q, max_seqlen_k, scale,
                        causal, window_left, window_right);
  const c10::cuda::CUDAGuard guard(q.device());
  const DType dtype = q.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  const KernelChoice kernel = find_fwd(device_arch(q), dtype, p.head_dim);
  TORCH_CHECK_NOT_IMPLEMENTED(kernel.fwd != nullptr, kernel.error);

  // Packed rows outside every sequence are never visited: zero / -inf them up front.
  Tensor out = varlen ? at::zeros(q.sizes(), q.options()) : at::empty(q.sizes(), q.options());
  Tensor lse = new_stats(q, varlen, p.batch, -std::numeric_limits<float>::infinity());
  p.q = ref(q, varlen);
  p.k = ref(k, varlen);
  p.v = ref(v, varlen);
  p.o = ref(out, varlen);
  p.lse = stats_ref(lse, varlen);
  check_launch(kernel.fwd(p, c10::cuda::getCurrentCUDAStream()), "forward", kernel.head_dim);
  return {out, lse};
}

// Gradients of a kv head are the sums over its query heads (heads h*r .. h*r + r - 1).
Tensor sum_over_group(const Tensor& expanded, int64_t heads_kv) {
  auto sizes = expanded.sizes().vec();
  const int64_t ratio = sizes[sizes.size() - 2] / heads_kv;
  if (ratio == 1) return expanded;
  auto grouped = sizes;
  grouped[grouped.size() - 2] = heads_kv;
  grouped.insert(grouped.end() - 1, ratio);
  return expanded.view(grouped).sum(-2);
}

std::tuple<Tensor, Tensor, Tensor> bwd_cuda(
    const Tensor& dout_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
    const Tensor& out_in, const Tensor& lse, const OptTensor& cu_q, const OptTensor& cu_k,
    const OptTensor& used_q, const OptTensor& used_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    double scale, bool causal, int64_t window_left, int64_t window_right, bool deterministic) {
  TORCH_CHECK_NOT_IMPLEMENTED(!deterministic,
                              "deterministic=True is not supported by the CUDA backward yet: its "
                              "dq accumulation uses atomics; pass deterministic=False");
  const bool varlen = cu_q.has_value();
  const Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  const Tensor dout = aligned(dout_in), out = aligned(out_in);
  FwdParams f = problem(q, k, v, cu_q, cu_k, used_q, used_k, max_seqlen_q, max_seqlen_k, scale,
                        causal, window_left, window_right);
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                        dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                    "dout and out must have q's shape and dtype");
  TORCH_CHECK_VALUE(dout.device() == q.device() && out.device() == q.device() &&
                        lse.device() == q.device(),
                    "dout, out and softmax_lse must be on q's device");
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.is_contiguous(),
                    "softmax_lse must be a contiguous float32 tensor");
  const auto lse_shape = varlen ? std::vector<int64_t>{q.size(-2), q.size(0)}
                                : std::vector<int64_t>{q.size(0), q.size(-2), q.size(1)};
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef(lse_shape), "softmax_lse must have shape ",
                    shape(lse_shape), " (the forward's); got ", shape(lse.sizes()));
  const c10::cuda::CUDAGuard guard(q.device());
  const DType dtype = q.scalar_type() == at::kBFloat16 ? DType::kBFloat16 : DType::kFloat16;
  const KernelChoice kernel = find_bwd(device_arch(q), dtype, f.head_dim);
  TORCH_CHECK_NOT_IMPLEMENTED(kernel.bwd != nullptr, kernel.error);

  const int64_t heads_q = q.size(-2);
  auto expanded_sizes = k.sizes().vec();
  expanded_sizes[expanded_sizes.size() - 2] = heads_q;
  // Varlen rows past the last sequence are never visited, so those buffers start zeroed.
  auto make = [&](at::IntArrayRef sizes, at::TensorOptions opts) {
    return varlen ? at::zeros(sizes, opts) : at::empty(sizes, opts);
  };
  Tensor dq = make(q.sizes(), q.options());
  Tensor dk_expanded = make(expanded_sizes, k.options());
  Tensor dv_expanded = make(expanded_sizes, v.options());
  Tensor dot = new_stats(q, varlen, f.batch, 0.f);
  // The float32 dQ accumulator, in whole tiles per sequence (kDqAccumRowAlign in params.h); the
  // preprocess kernel zeroes it.
  const int64_t acc_d = kernel.head_dim;
  const int64_t align = kDqAccumRowAlign;
  const int64_t acc_rows = varlen ? q.size(0) + f.batch * align
                                  : (q.size(1) + align - 1) / align * align;
  const int64_t acc_batches = varlen ? 1 : f.batch;
  Tensor dq_accum = at::empty({acc_batches * heads_q * acc_rows * acc_d},
                              q.options().dtype(at::kFloat));

  f.q = ref(q, varlen);
  f.k = ref(k, varlen);
  f.v = ref(v, varlen);
  f.o = ref(out, varlen);
  f.lse = stats_ref(lse, varlen);
  BwdParams p;
  p.fwd = f;
  p.dout = ref(dout, varlen);
  p.dq = ref(dq, varlen);
  p.dq_accum.ptr = dq_accum.data_ptr();
  p.dq_accum.batch_stride = varlen ? 0 : heads_q * acc_rows * acc_d;
  p.dq_accum.head_stride = acc_rows * acc_d;
  p.dq_accum.row_stride = acc_d;
  p.dq_accum_floats = dq_accum.numel();
  p.dk = ref(dk_expanded, varlen);
  p.dv = ref(dv_expanded, varlen);
  p.dot_do_o = stats_ref(dot, varlen);
  p.total_rows_q = varlen ? q.size(0) : q.size(0) * q.size(1);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(sm80::run_bwd_preprocess(p, dtype, stream));
  check_launch(kernel.bwd(p, stream), "backward", kernel.head_dim);

  return {dq, sum_over_group(dk_expanded, k.size(-2)), sum_over_group(dv_expanded, k.size(-2))};
}

pybind11::dict build_info() {
  pybind11::dict info;
  pybind11::list archs, kernels;
  for (int a : compiled_archs()) archs.append(a);
  pybind11::dict head_dims;
  head_dims["fwd"] = pybind11::list();
  head_dims["bwd"] = pybind11::list();
  pybind11::set dtypes;
  for (const KernelEntry& e : compiled_kernels()) {
    kernels.append(kernel_name(e));
    pybind11::list l = head_dims[e.direction];
    if (!l.contains(e.head_dim)) l.append(e.head_dim);
    dtypes.add(dtype_short_name(e.dtype));
  }
  info["archs"] = archs;
  info["head_dims"] = head_dims;
  info["dtypes"] = dtypes;
  info["kernels"] = kernels;
  pybind11::dict features;
  features["backward"] = pybind11::len(head_dims["bwd"]) > 0;
  features["varlen"] = true;
  features["causal"] = true;
  features["local"] = true;
  features["gqa"] = true;
  features["seqused"] = true;
  features["deterministic_backward"] = false;
  info["features"] = features;
  return info;
}

}  // namespace
}  // namespace flash_cuda

// Schemas are written once, here.  Dense when cu_seqlens_q is None; max_seqlen_* are SymInt so
// that a traced value needs no host sync.
TORCH_LIBRARY(flash_cuda, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
      "Tensor? seqused_q, Tensor? seqused_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
      "float softmax_scale, bool causal, int window_left, int window_right) "
      "-> (Tensor out, Tensor softmax_lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, "
      "int window_left, int window_right, bool deterministic) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_cuda, CUDA, m) {
  m.impl("fwd", &flash_cuda::fwd_cuda);
  m.impl("bwd", &flash_cuda::bwd_cuda);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_cuda kernels; the ops are torch.ops.flash_cuda.fwd / .bwd";
  m.def("build_info", &flash_cuda::build_info,
        "What this build holds: archs, head dims per direction, dtypes, kernels, features.");
}
