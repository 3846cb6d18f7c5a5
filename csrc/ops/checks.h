// The op rules' C++ side (Note [Checks in two places] in attention_cuda.cpp): the pieces the
// CUDA kernels of fwd / bwd (attention_cuda.cpp) and fwd_kvcache (kvcache_cuda.cpp) share,
// each with the message flash_cuda/_checks.py gives for the same rule.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <cmath>
#include <optional>
#include <sstream>
#include <string>

namespace flash_cuda {

// torch's Python names of dtypes, as the messages of flash_cuda/_checks.py print them.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kUInt16: return "uint16";
    case at::kUInt32: return "uint32";
    case at::kUInt64: return "uint64";
    case at::kComplexHalf: return "complex32";
    case at::kComplexFloat: return "complex64";
    case at::kComplexDouble: return "complex128";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kFloat8_e4m3fnuz: return "float8_e4m3fnuz";
    case at::kFloat8_e5m2fnuz: return "float8_e5m2fnuz";
    default: {  // Python's names are c10's in lower case (Float8_e8m0fnu, UInt1, QInt8, Bits8)
      std::string name = c10::toString(t);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return name;
    }
  }
}

// A shape as Python prints a tuple: (2, 3) and (3,).
inline std::string shape(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << (sizes.size() == 1 ? ",)" : ")");
  return out.str();
}

// A CUDA argument brings a call to a CUDA kernel even when q is on the CPU; the rules are q's
// device's (and a device check after this one names the misplaced argument).
inline void check_q_dtype(const at::Tensor& q) {
  const bool float32_ok = !q.is_cuda();
  TORCH_CHECK_VALUE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16 ||
                        (float32_ok && q.scalar_type() == at::kFloat),
                    "q has dtype ", dtype_name(q.scalar_type()),
                    ", which flash_cuda does not support on ", q.device().type(),
                    "; use float16 or bfloat16 (float32 is also accepted on the CPU).");
}

inline void check_rank(const char* name, const at::Tensor& t, bool varlen) {
  TORCH_CHECK_VALUE(t.dim() == (varlen ? 3 : 4), name, " must be ",
                    varlen ? "3-D (total_tokens, heads, head_dim) for varlen attention "
                             "(cu_seqlens given)"
                           : "4-D (batch, seqlen, heads, head_dim) for dense attention "
                             "(no cu_seqlens)",
                    "; got shape ", shape(t.sizes()), ".");
}

inline void check_index_tensor(const std::optional<at::Tensor>& t, const char* name, int64_t length,
                               const at::Tensor& q) {
  if (!t.has_value()) return;
  TORCH_CHECK_VALUE(t->scalar_type() == at::kInt, name, " must have dtype int32; got ",
                    dtype_name(t->scalar_type()), ". ", name, ".to(torch.int32) would do.");
  TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == length, name, " must be 1-D with ", length,
                    " entries; got shape ", shape(t->sizes()), ".");
  TORCH_CHECK_VALUE(t->device() == q.device(), name, " must be on q's device (", q.device(),
                    "); got ", t->device(), ".");
  TORCH_CHECK_VALUE(t->stride(0) == 1 || length <= 1, name,
                    " must be contiguous (the kernels index it as a plain array); got stride ",
                    t->stride(0), ". ", name, ".contiguous() would do.");
}

inline void check_window(int64_t window_left, int64_t window_right) {
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1,
                    "window_size entries must be >= -1 (-1 means unbounded on that side); got (",
                    window_left, ", ", window_right, ").");
}

// The kernels take scale * log2(e) in float32 (flash_cuda/_checks.py: SCALE_MIN, SCALE_MAX).
inline void check_scale(double scale) {
  TORCH_CHECK_VALUE(scale >= 1e-30 && scale <= 1e30,  // false for NaN too
                    "softmax_scale must be a finite number > 0, within [1e-30, 1e+30] (the "
                    "kernels take the running max of unscaled scores and scale in float32); got ",
                    std::isnan(scale) ? "nan" : c10::str(scale), ".");  // Python prints no sign
}

}  // namespace flash_cuda
