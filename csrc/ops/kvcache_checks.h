// The rules of torch.ops.flash_cuda.fwd_kvcache for its CUDA kernel (kvcache_cuda.cpp): the C++
// side of flash_cuda/_checks.py's check_kvcache_op, in its order and with its messages (Note
// [Checks in two places] in attention_cuda.cpp).  Host code on ATen alone, so that a CPU-only
// harness can hold it beside the Python rules (tests/test_kvcache.py).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <utility>

#include "ops/checks.h"

namespace flash_cuda {

// _checks.py's check_like: a tensor of q's dtype and device, of `rank`, `heads` heads and q's
// head dim, with a contiguous last dimension.
inline void check_like(const char* name, const at::Tensor& t, const at::Tensor& q, int64_t rank, int64_t heads,
                const char* heads_name) {
  TORCH_CHECK_VALUE(t.dim() == rank, name, " must be ", rank, "-D; got shape ", shape(t.sizes()),
                    ".");
  TORCH_CHECK_VALUE(t.scalar_type() == q.scalar_type() && t.device() == q.device(), name,
                    " must have q's dtype (", dtype_name(q.scalar_type()), ") and device (",
                    q.device(), "); got ", dtype_name(t.scalar_type()), " on ", t.device(), ".");
  TORCH_CHECK_VALUE(t.size(-2) == heads && t.size(-1) == q.size(-1), name, " must have ", heads,
                    " heads (", heads_name, ") and q's head dim ", q.size(-1),
                    " in its last two dimensions; got shape ", shape(t.sizes()), ".");
  TORCH_CHECK_VALUE(t.stride(-1) == 1, name, " must have a contiguous last dimension; got stride ",
                    t.stride(-1), ".");
}

// The rules of torch.ops.flash_cuda.fwd_kvcache, in the order and with the messages of
// flash_cuda/_checks.py's check_kvcache_op (Note [Checks in two places] in attention_cuda.cpp);
// returns the batch size.
inline int64_t check_kvcache_op(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& rotary_cos,
                         const std::optional<at::Tensor>& rotary_sin, const std::optional<at::Tensor>& cache_seqlens,
                         const std::optional<at::Tensor>& cache_batch_idx, const std::optional<at::Tensor>& cache_leftpad,
                         const std::optional<at::Tensor>& page_table, const std::optional<at::Tensor>& cu_seqlens_q,
                         const std::optional<at::Tensor>& cu_seqlens_k_new, std::optional<int64_t> max_seqlen_q,
                         const std::optional<at::Tensor>& rotary_seqlens, double softmax_scale,
                         int64_t window_left, int64_t window_right, const at::Tensor& out) {
  const auto type = q.device().type();
  TORCH_CHECK_VALUE(type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA ||
                        type == c10::DeviceType::Meta,
                    "q is on ", q.device(), "; flash_cuda runs on CUDA devices and on the CPU "
                    "(the reference implementation).");
  check_q_dtype(q);
  const bool varlen_q = cu_seqlens_q.has_value();
  check_rank("q", q, varlen_q);
  const int64_t heads_kv = k_cache.dim() == 4 ? k_cache.size(-2) : 0;
  check_like("k_cache", k_cache, q, 4, heads_kv, "k_cache's");
  check_like("v_cache", v_cache, q, 4, heads_kv, "k_cache's");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must have the same shape; got ", shape(k_cache.sizes()),
                    " and ", shape(v_cache.sizes()), ".");
  const int64_t d = q.size(-1);
  TORCH_CHECK_VALUE(d % 8 == 0 && d >= 8 && d <= 256,
                    "the head dim of q, k and v (their last dimension) must be a multiple of 8 "
                    "between 8 and 256; got ", d, ". Pad it with zeros up to the next multiple "
                    "of 8 if needed.");
  TORCH_CHECK_VALUE(heads_kv != 0 && q.size(-2) % heads_kv == 0, "the number of heads of q (",
                    q.size(-2), ") must be a multiple of the number of heads of the cache (",
                    heads_kv, ") (MHA, GQA or MQA).");
  if (varlen_q) {
    TORCH_CHECK_VALUE(cu_seqlens_q->dim() == 1 && cu_seqlens_q->size(0) >= 1,
                      "cu_seqlens_q must be 1-D with batch + 1 >= 1 entries; got shape ",
                      shape(cu_seqlens_q->sizes()), ".");
  }
  const int64_t batch = varlen_q ? cu_seqlens_q->size(0) - 1 : q.size(0);
  if (varlen_q) {
    check_index_tensor(cu_seqlens_q, "cu_seqlens_q", batch + 1, q);
    TORCH_CHECK_VALUE(max_seqlen_q.has_value(),
                      "max_seqlen_q is required with cu_seqlens_q (it sizes the grid).");
    TORCH_CHECK_VALUE(*max_seqlen_q >= 0, "max_seqlen_q must be >= 0; got ", *max_seqlen_q, ".");
  }
  TORCH_CHECK_VALUE(k.has_value() == v.has_value(),
                    "k and v go together: pass both (they are appended to the cache) or "
                    "neither.");
  TORCH_CHECK_VALUE(!cu_seqlens_k_new.has_value() || k.has_value(),
                    "cu_seqlens_k_new describes packed new keys: pass k and v with it.");
  if (k.has_value()) {
    const bool varlen_k = cu_seqlens_k_new.has_value();
    check_like("k", *k, q, varlen_k ? 3 : 4, heads_kv, "the cache's");
    check_like("v", *v, q, varlen_k ? 3 : 4, heads_kv, "the cache's");
    TORCH_CHECK_VALUE(k->sizes() == v->sizes(), "k and v must have the same shape; got ",
                      shape(k->sizes()), " and ", shape(v->sizes()), ".");
    if (varlen_k) {
      check_index_tensor(cu_seqlens_k_new, "cu_seqlens_k_new", batch + 1, q);
    } else {
      TORCH_CHECK_VALUE(k->size(0) == batch, "k and v must have q's batch size ", batch,
                        " in dimension 0; got ", k->size(0), ".");
    }
    TORCH_CHECK_VALUE(cache_seqlens.has_value(),
                      "cache_seqlens (where the new keys go) is required with k and v.");
  }
  check_index_tensor(cache_seqlens, "cache_seqlens", batch, q);
  check_index_tensor(cache_batch_idx, "cache_batch_idx", batch, q);
  check_index_tensor(cache_leftpad, "cache_leftpad", batch, q);
  check_index_tensor(rotary_seqlens, "rotary_seqlens", batch, q);
  if (page_table.has_value()) {
    const at::Tensor& t = *page_table;
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt && t.dim() == 2 && t.size(0) == batch &&
                          t.device() == q.device(),
                      "page_table must be int32 of shape (batch=", batch, ", pages per sequence) "
                      "on q's device; got ", dtype_name(t.scalar_type()), " of shape ",
                      shape(t.sizes()), " on ", t.device(), ".");
    TORCH_CHECK_VALUE(!cache_batch_idx.has_value(),
                      "cache_batch_idx selects rows of a dense cache; with a page_table the "
                      "table maps sequences to pages: pass one or the other.");
  }
  TORCH_CHECK_VALUE(k_cache.size(0) != 0 || batch == 0, "k_cache has no ",
                    page_table.has_value() ? "pages" : "rows",
                    " in dimension 0; the batch has ", batch, " sequences.");
  TORCH_CHECK_VALUE(page_table.has_value() || cache_batch_idx.has_value() ||
                        k_cache.size(0) >= batch,
                    "k_cache holds ", k_cache.size(0), " cache rows in dimension 0 for a batch "
                    "of ", batch, " sequences: pass cache_batch_idx to pick rows, or a cache "
                    "with at least ", batch, " rows.");
  TORCH_CHECK_VALUE(rotary_cos.has_value() == rotary_sin.has_value(),
                    "rotary_cos and rotary_sin go together: pass both or neither.");
  if (rotary_cos.has_value()) {
    TORCH_CHECK_VALUE(k.has_value(), "rotary_cos / rotary_sin rotate the new keys (and q): pass "
                      "k and v too.");
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"rotary_cos",
                                                                         &*rotary_cos},
                                  {"rotary_sin", &*rotary_sin}}) {
      TORCH_CHECK_VALUE(t->dim() == 2 && t->sizes() == rotary_cos->sizes() &&
                            t->device() == q.device(),
                        name, " must be 2-D (positions, rotary_dim / 2), of rotary_cos's shape, "
                        "on q's device; got shape ", shape(t->sizes()), " on ", t->device(), ".");
    }
    TORCH_CHECK_VALUE(rotary_cos->size(0) != 0,
                      "rotary_cos / rotary_sin must hold at least one position (row).");
    const int64_t rotary_dim = 2 * rotary_cos->size(1);
    TORCH_CHECK_VALUE(rotary_dim % 16 == 0 && rotary_dim > 0 && rotary_dim <= d,
                      "the rotary dim (2 * rotary_cos.shape[1] = ", rotary_dim, ") must be a "
                      "multiple of 16 between 16 and the head dim ", d, ".");
  }
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                        out.device() == q.device(),
                    "out must have q's shape ", shape(q.sizes()), ", dtype (",
                    dtype_name(q.scalar_type()), ") and device (", q.device(), "); got shape ",
                    shape(out.sizes()), ", ", dtype_name(out.scalar_type()), " on ",
                    out.device(), ".");
  TORCH_CHECK_VALUE(out.numel() == 0 || out.stride(-1) == 1,
                    "out must have a contiguous last dimension; got stride ", out.stride(-1), ".");
  check_window(window_left, window_right);
  check_scale(softmax_scale);
  return batch;
}

}  // namespace flash_cuda
