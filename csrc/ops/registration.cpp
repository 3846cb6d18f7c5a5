// The op schemas of torch.ops.flash_cuda.* and the flash_cuda._C module (build_info).  It needs
// no CUDA, so a build without nvcc still defines the ops: their CPU, fake and autograd
// implementations are registered from Python (flash_cuda/_ops.py), the CUDA ones in
// attention_cuda.cpp (fwd, bwd) and kvcache_cuda.cpp (fwd_kvcache, _combine_cuda,
// _kvcache_num_splits).
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include <c10/util/Exception.h>

namespace flash_cuda {
namespace {

struct BuiltKernel {
  const char* name;  // the manifest's, e.g. "fwd_sm80_bf16_hdim128"
  const char* direction;
  const char* family;
  const char* dtype;  // the manifest's short name: "bf16" / "fp16"
  int head_dim;
};

// A compiled family, in the manifest's preference order.
struct BuiltFamily {
  const char* name;
  const char* targets;  // what its units were compiled to, space-separated: "sm_90a"
  int min_arch, end_arch;  // the compute capabilities it serves: [min_arch, end_arch)
  const char* ops;  // the ops it holds kernels for, space-separated: "fwd bwd"
};

#include "generated/build_info.inc"

const std::vector<BuiltKernel> kKernels = FLASH_CUDA_BUILD_KERNELS;
const std::vector<int> kArchs = FLASH_CUDA_BUILD_ARCHS;
const std::vector<BuiltFamily> kFamilies = FLASH_CUDA_BUILD_FAMILIES;

pybind11::list words(const std::string& text) {
  pybind11::list out;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(' ', start);
    if (end == std::string::npos) end = text.size();
    if (end > start) out.append(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

pybind11::dict build_info() {
  pybind11::dict info, head_dims, features, family_info;
  pybind11::list archs, kernels, families;
  pybind11::set dtypes;
  head_dims["fwd"] = pybind11::list();
  head_dims["bwd"] = pybind11::list();
  head_dims["fwd_kvcache"] = pybind11::list();
  for (int arch : kArchs) archs.append(arch);
  for (const BuiltKernel& k : kKernels) {
    kernels.append(k.name);
    pybind11::list dims = head_dims[k.direction];
    if (!dims.contains(k.head_dim)) dims.append(k.head_dim);
    dtypes.add(k.dtype);
  }
  for (const BuiltFamily& f : kFamilies) {
    families.append(f.name);
    pybind11::dict d;
    d["targets"] = words(f.targets);
    d["serves"] = pybind11::make_tuple(f.min_arch, f.end_arch);
    d["ops"] = words(f.ops);
    family_info[f.name] = d;
  }
  info["archs"] = archs;
  info["head_dims"] = head_dims;
  info["dtypes"] = dtypes;
  info["kernels"] = kernels;
  info["families"] = families;  // preference order
  // name -> {"targets": ["sm_90a"], "serves": (min_arch, end_arch), "ops": ["fwd"]}
  info["family_info"] = family_info;
  features["backward"] = pybind11::len(head_dims["bwd"]) > 0;
  features["kvcache"] = pybind11::len(head_dims["fwd_kvcache"]) > 0;
  features["varlen"] = true;
  features["causal"] = true;
  features["local"] = true;
  features["gqa"] = true;
  features["seqused"] = true;
  features["deterministic_backward"] = false;
  info["features"] = features;
  return info;
}

// The message of a failed TORCH_CHECK that formats a double and an integer: the build's check
// that the extension formats numbers with the C++ runtime torch uses (Note [One C++ runtime] in
// csrc/toolchain.py).  tests/test_build.py calls it.
std::string check_message_with_numbers(double x, int64_t n) {
  try {
    TORCH_CHECK_VALUE(false, "formatted ", x, " and ", n);
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  }
  return "";
}

}  // namespace
}  // namespace flash_cuda

// Schemas are written once, here.  Dense when cu_seqlens_q is None; max_seqlen_* are SymInt so
// that a traced value needs no host sync.  fwd's `deterministic` only reaches its autograd
// formula (flash_cuda/_ops.py), which passes it to bwd.
TORCH_LIBRARY(flash_cuda, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
      "Tensor? seqused_q, Tensor? seqused_k, SymInt max_seqlen_q, SymInt max_seqlen_k, "
      "float softmax_scale, bool causal, int window_left, int window_right, "
      "bool deterministic=False) -> (Tensor out, Tensor softmax_lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
      "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? seqused_q, Tensor? seqused_k, "
      "SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, "
      "int window_left, int window_right, bool deterministic) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  // Attention over a KV cache (flash_attn_with_kvcache), forward only.  k_cache and v_cache are
  // written in place when k and v are given, and out always (the API allocates it unless the
  // caller passes one), so the schema declares them mutated; it returns the rows' lse.
  m.def(
      "fwd_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k, Tensor? v, "
      "Tensor? rotary_cos, Tensor? rotary_sin, Tensor? cache_seqlens, Tensor? cache_batch_idx, "
      "Tensor? cache_leftpad, Tensor? page_table, Tensor? cu_seqlens_q, "
      "Tensor? cu_seqlens_k_new, SymInt? max_seqlen_q, Tensor? rotary_seqlens, "
      "float softmax_scale, bool causal, int window_left, int window_right, "
      "bool rotary_interleaved, int num_splits, Tensor(c!) out) -> Tensor softmax_lse");
  // The split count the KV-cache kernels take for a problem of these sizes on cache_seqlens'
  // device (get_scheduler_metadata; internal).
  m.def(
      "_kvcache_num_splits(Tensor cache_seqlens, int batch, int seqlen_q, bool varlen_q, "
      "int heads_q, int heads_kv, int head_dim, int capacity, ScalarType dtype, "
      "int window_left, int num_splits, int page_size, bool leftpad) -> int");
  // flash_attn_combine's fused CUDA kernel for partials laid out as it needs (internal: call
  // combine instead, which checks the rules and picks it).
  m.def("_combine_cuda(Tensor out_partial, Tensor lse_partial, Tensor(a!) out) -> Tensor");
  // Merges split-KV partial results (flash_attn_combine) into `out`, written in place;
  // returns the rows' lse.  Its implementations are flash_cuda/_ops.py's, on every device.
  m.def("combine(Tensor out_partial, Tensor lse_partial, Tensor(a!) out) -> Tensor softmax_lse");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_cuda's compiled part: the torch.ops.flash_cuda schemas and CUDA kernels";
  m.def("build_info", &flash_cuda::build_info,
        "What this build holds: archs, head dims per direction, dtypes, kernels, families, "
        "features.");
  m.def("_check_message_with_numbers", &flash_cuda::check_message_with_numbers,
        "The message of a failed check 'formatted <x> and <n>': a self-test of the C++ runtime.");
}
