// The Hopper family's attention over a KV cache: the problems whose keys are plain rows of a
// dense cache (no pages, no cache_batch_idx, no leftpad) and whose queries are many (a chunked
// prefill), which are the sm90 forward's problems once the new keys are in the cache: the
// append and q's rotation (common/append_kv.cuh), each sequence's key count as seqused, then
// sm90::run_fwd (its own unit: this one compiles no attention kernel).  Decode steps and paged
// caches go to the portable family, whose kernel splits the keys.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/append_kv.cuh"
#include "common/launch.cuh"
#include "common/launch_api.h"
#include "common/seqlen_info.cuh"

namespace flash_cuda::sm90 {

// Query rows from which a dense-cache problem runs here.
constexpr int kKvcacheMinQueryRows = 128;

// Each sequence's keys (cache_seqlens + its new rows, clamped to the capacity).
// (static: every unit that includes this header has its own copy.)
static __global__ void kvcache_lengths_kernel(const KvCacheArgs kv, int batch, int* lengths) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) lengths[b] = SeqlenInfo(kv, b).len;
}

// The forward problem over the cache, its keys counted by `lengths` (null while sizing).
inline FwdParams kvcache_as_forward(const KvcacheParams& kp, int* lengths, void* q_rot) {
  FwdParams p = kp.fwd;
  p.seq_k = SeqArgs();
  p.seq_k.seqused = lengths;
  p.seq_k.seqlen = p.kv.capacity;
  if (q_rot != nullptr) p.q = rotated_q_ref(p, q_rot);
  return p;
}

template <class ElementTag, int kHeadDim> bool fwd_kvcache_supports(const KvcacheParams& kp) {
  const FwdParams& p = kp.fwd;
  if (p.kv.page_table != nullptr || p.kv.batch_idx != nullptr || p.kv.leftpad != nullptr ||
      p.split.num_splits > 1 || p.seq_q.seqlen < kKvcacheMinQueryRows ||
      p.kv.cache_dim0 < p.batch) {
    return false;
  }
  return fwd_supports<ElementTag, kHeadDim>(kvcache_as_forward(kp, nullptr, nullptr));
}

template <class ElementTag, int kHeadDim> int fwd_kvcache_num_splits(const KvcacheParams&) {
  return 1;
}

// The workspace: the key counts, the rotated q (when rotary), then the forward's own.
struct KvcacheWorkspace {
  size_t lengths = 0, q = 0, forward = 0;
};

template <class ElementTag, int kHeadDim>
KvcacheWorkspace kvcache_workspace(const KvcacheParams& kp) {
  auto round_up = [](size_t n) { return (n + 255) / 256 * 256; };
  const FwdParams& p = kp.fwd;
  KvcacheWorkspace w;
  w.lengths = round_up(size_t(p.batch) * sizeof(int));
  if (kp.rotary.cos != nullptr) {
    const int64_t rows = p.seq_q.cu_seqlens != nullptr ? int64_t(p.seq_q.total_rows)
                                                       : int64_t(p.batch) * p.seq_q.seqlen;
    w.q = round_up(size_t(rows) * p.heads_q * p.head_dim * 2);  // 16-bit elements
  }
  w.forward = fwd_workspace_bytes<ElementTag, kHeadDim>(kvcache_as_forward(kp, nullptr, nullptr));
  return w;
}

template <class ElementTag, int kHeadDim>
size_t fwd_kvcache_workspace_bytes(const KvcacheParams& kp) {
  const KvcacheWorkspace w = kvcache_workspace<ElementTag, kHeadDim>(kp);
  return w.lengths + w.q + w.forward;
}

template <class ElementTag, int kHeadDim>
cudaError_t run_fwd_kvcache(const KvcacheParams& kp, void* workspace, cudaStream_t stream) {
  using Element = typename DeviceType<ElementTag>::type;
  const KvcacheWorkspace w = kvcache_workspace<ElementTag, kHeadDim>(kp);
  char* base = static_cast<char*>(workspace);
  int* lengths = reinterpret_cast<int*>(base);
  Element* q_rot = w.q > 0 ? reinterpret_cast<Element*>(base + w.lengths) : nullptr;
  void* forward_workspace = w.forward > 0 ? base + w.lengths + w.q : nullptr;
  cudaError_t err = append_and_rotate<Element>(kp, q_rot, stream);
  if (err != cudaSuccess || kp.fwd.batch == 0) return err;
  kvcache_lengths_kernel<<<(kp.fwd.batch + 127) / 128, 128, 0, stream>>>(kp.fwd.kv, kp.fwd.batch,
                                                                        lengths);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return run_fwd<ElementTag, kHeadDim>(kvcache_as_forward(kp, lengths, q_rot), forward_workspace,
                                       stream);
}

}  // namespace flash_cuda::sm90
