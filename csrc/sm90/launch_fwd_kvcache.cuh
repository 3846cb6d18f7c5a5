// The Hopper family's attention over a KV cache: the problems whose queries are many (a chunked
// prefill), which are the sm90 forward's problems once the new keys are in the cache: the
// append and q's rotation (common/append_kv.cuh), each sequence's key count as seqused, then
// the forward kernel in its variant that reads the cache in place (CacheKernelFor, compiled in
// this unit): a dense cache, one under cache_batch_idx, pages of whole key tiles (Note [Keys in
// place]).  Other keys (smaller pages, leftpad) are first gathered into dense rows of the
// workspace (Note [Gathered keys]).  Decode steps and forced splits go to the portable family,
// whose kernel splits the keys.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/append_kv.cuh"
#include "common/launch.cuh"
#include "common/launch_api.h"
#include "common/seqlen_info.cuh"
#include "sm90/launch_fwd.cuh"
#include "sm90/tile_config.h"

namespace flash_cuda::sm90 {

// The forward this launcher runs: the forward's tiles, K and V read from the cache in place
// where Note [Keys in place] allows (compiled in the KV-cache units, apart from the forward's).
template <class ElementTag, int kHeadDim>
using CacheKernelFor = FwdKernel<ElementTag, kHeadDim, CacheKeysConfig<FwdTileConfig<kHeadDim>>>;

// Query rows from which a problem runs here.
constexpr int kKvcacheMinQueryRows = 128;

// Note [Gathered keys]
// The forward reads K and V by TMA, as rows (row, head, batch) of one tensor.  Pages smaller
// than a key tile and a leftpad put a sequence's keys where it cannot read them in place (Note
// [Keys in place]), so for those problems a copy kernel first gathers each sequence's keys
// (rows leftpad .. its length, in cache order) into dense rows of the workspace, (batch,
// capacity, heads_kv, d) for K and the same for V, and the forward runs over them.  The copy
// reads and writes K and V once more, which a chunked prefill's many query rows make cheap
// next to its GEMMs (benchmarks/NOTES.md entry 85).  Only rows below each length are written:
// the forward's keys past seqused are masked, and V's rows there zeroed (Note [Hopper forward
// pipeline] in sm90/fwd_kernel.cuh).  The lengths live on the
// GPU, so the buffer holds `capacity` rows a sequence (a page table's width times the page
// size): batches whose buffer would pass kGatherMaxBytes go in chunks of sequences (a gather
// and a forward each) while a chunk's query tiles fill half the GPU; a call whose chunks would
// not, or whose sequences are over kGatherMaxBytes each, goes to the portable family, which
// reads pages in place with no buffer.
constexpr size_t kGatherMaxBytes = size_t(256) << 20;
constexpr int kGatherRows = 32;  // cache rows per block of the gather
constexpr int kGatherThreads = 256;

// Note [Keys in place]
// Two kinds of cache the forward reads as they are, its TMA descriptors over the cache itself
// (sm90::run_fwd_for) and each key tile's coordinates from the producer
// (FwdKernel::load_from_cache): a dense
// cache under cache_batch_idx (a sequence's tiles in the cache row batch_idx[b], clamped), and
// pages of whole key tiles (page_size a multiple of the kernel's kBlockN, where that is a power
// of two, so head dims up to 128 and pages of 128 rows or more: key tile n is tile
// n mod page_size / kBlockN of page page_table[b][n kBlockN / page_size], clamped).  A page's
// rows past a sequence's keys are other data, so the consumers zero every row of V's last tile
// past the keys.  No leftpad: its rows do not start a tile.  Everything else is gathered first.
template <int kBlockN> bool reads_in_place(const KvCacheArgs& kv) {
  return kv.leftpad == nullptr &&
         (kv.page_table == nullptr ||
          (pages_in_place(kBlockN) && kv.page_size > 0 && kv.page_size % kBlockN == 0));
}

template <int kBlockN> bool gathers_keys(const KvCacheArgs& kv) {
  return (kv.page_table != nullptr || kv.batch_idx != nullptr || kv.leftpad != nullptr) &&
         !reads_in_place<kBlockN>(kv);
}

// Bytes of gathered K and V per sequence.
template <class Element> size_t gathered_bytes_per_seq(const FwdParams& p) {
  return 2 * size_t(p.kv.capacity) * p.heads_kv * p.head_dim * sizeof(Element);
}

// Sequences per gather (the whole batch when the keys need no gather).
template <class Element, int kBlockN> int gather_chunk(const FwdParams& p) {
  if (!gathers_keys<kBlockN>(p.kv) || p.batch == 0) return p.batch;
  const size_t per_seq = std::max<size_t>(gathered_bytes_per_seq<Element>(p), 1);
  // At most 65535: the gather's grid.y.
  return int(std::min<size_t>(std::min(p.batch, 65535),
                              std::max<size_t>(kGatherMaxBytes / per_seq, 1)));
}

struct GatherArgs {
  TensorRef k_cache, v_cache;  // batch_stride: the stride of the cache's dimension 0
  KvCacheArgs kv;
  void* k_out = nullptr;  // (chunk, capacity, heads_kv, head_dim), dense
  void* v_out = nullptr;
  int first = 0;  // the chunk's first sequence
  int heads_kv = 0;
  int head_dim = 0;
};

// Grid (row blocks of kGatherRows, sequences of the chunk): block (x, y) copies rows
// x * kGatherRows .. of sequence first + y that lie below its length, 16 bytes a thread and four
// loads in flight before their stores.  Pages and cache rows are clamped as the append's are.
template <class Element>
__global__ void __launch_bounds__(kGatherThreads) gather_kv_kernel(const GatherArgs g) {
  const int slot = blockIdx.y;
  const int b = g.first + slot;
  const KvCacheArgs& kv = g.kv;
  const SeqlenInfo keys(kv, b);  // offset: the leftpad rows, len: the keys after them
  const int row0 = blockIdx.x * kGatherRows;
  const int rows = min(kGatherRows, keys.len - row0);
  if (rows <= 0) return;
  const int chunks_d = g.head_dim / 8;
  const int chunks_row = g.heads_kv * chunks_d;
  const int total = rows * chunks_row;
  const int cache_row = kv.batch_idx != nullptr ? min(max(kv.batch_idx[b], 0), kv.cache_dim0 - 1)
                                                : min(b, kv.cache_dim0 - 1);
  const Element* k_src = static_cast<const Element*>(g.k_cache.ptr);
  const Element* v_src = static_cast<const Element*>(g.v_cache.ptr);
  const int64_t out_row0 = (int64_t(slot) * kv.capacity + row0) * chunks_row * 8;
  uint4* k_dst = reinterpret_cast<uint4*>(static_cast<Element*>(g.k_out) + out_row0);
  uint4* v_dst = reinterpret_cast<uint4*>(static_cast<Element*>(g.v_out) + out_row0);
  constexpr int kInFlight = 4;
  for (int t0 = threadIdx.x; t0 < total; t0 += kGatherThreads * kInFlight) {
    uint4 k[kInFlight], v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int t = min(t0 + u * kGatherThreads, total - 1);  // loads stay unconditional
      const int r = t / chunks_row;
      const int rest = t - r * chunks_row;
      const int head = rest / chunks_d;
      const int col = (rest - head * chunks_d) * 8;
      const int row = keys.offset + row0 + r;  // < capacity: SeqlenInfo clamps the length
      int64_t offset;
      if (kv.page_table != nullptr) {
        offset = paged_row_offset(kv, g.k_cache, b, row);
      } else {
        offset = int64_t(cache_row) * g.k_cache.batch_stride + int64_t(row) * g.k_cache.row_stride;
      }
      offset += int64_t(head) * g.k_cache.head_stride + col;  // v_cache has k_cache's strides
      k[u] = *reinterpret_cast<const uint4*>(k_src + offset);
      v[u] = *reinterpret_cast<const uint4*>(v_src + offset);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int t = t0 + u * kGatherThreads;
      if (t < total) {
        k_dst[t] = k[u];
        v_dst[t] = v[u];
      }
    }
  }
}

// Each sequence's keys (cache_seqlens + its new rows, clamped to the capacity).
// (static: every unit that includes this header has its own copy.)
static __global__ void kvcache_lengths_kernel(const KvCacheArgs kv, int batch, int* lengths) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < batch) lengths[b] = SeqlenInfo(kv, b).len;
}

// The dense rows a chunk's keys (or values) are gathered into: (chunk, capacity, heads_kv, d).
inline TensorRef gathered_ref(const FwdParams& p, void* ptr) {
  TensorRef r;
  r.ptr = ptr;
  r.head_stride = p.head_dim;
  r.row_stride = int64_t(p.heads_kv) * p.head_dim;
  r.batch_stride = int64_t(p.kv.capacity) * r.row_stride;
  return r;
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

// Sequences [first, first + count) of a forward problem whose keys were gathered to k / v: its
// per-sequence pointers moved to `first` (packed rows keep theirs: cu_seqlens hold absolute
// offsets, and a packed tensor's batch stride is 0).  Its K and V are dense rows now: no
// cache arguments (the forward would read pages or cache rows through them).
template <class Element>
FwdParams gathered_chunk(FwdParams p, int first, int count, void* k, void* v) {
  auto at = [&](TensorRef t) {
    if (t.ptr != nullptr) t.ptr = static_cast<Element*>(t.ptr) + first * t.batch_stride;
    return t;
  };
  p.q = at(p.q);
  p.o = at(p.o);
  if (p.lse.ptr != nullptr) p.lse.ptr += first * p.lse.batch_stride;
  if (p.seq_q.cu_seqlens != nullptr) p.seq_q.cu_seqlens += first;
  if (p.seq_q.seqused != nullptr) p.seq_q.seqused += first;
  if (p.seq_k.seqused != nullptr) p.seq_k.seqused += first;
  p.batch = count;
  p.k = gathered_ref(p, k);
  p.v = gathered_ref(p, v);
  p.kv = KvCacheArgs();
  return p;
}

template <class ElementTag, int kHeadDim> bool fwd_kvcache_supports(const KvcacheParams& kp) {
  const FwdParams& p = kp.fwd;
  using Element = typename DeviceType<ElementTag>::type;
  if (p.split.num_splits > 1 || p.seq_q.seqlen < kKvcacheMinQueryRows) return false;
  constexpr int kBlockN = FwdTileConfig<kHeadDim>::kBlockN;
  if (gathers_keys<kBlockN>(p.kv)) {
    // The gathered rows are TMA's (dense, aligned); the cache itself is read by the gather.
    if (gathered_bytes_per_seq<Element>(p) > kGatherMaxBytes) return false;
    const int chunk = gather_chunk<Element, kBlockN>(p);
    int sms = 0;
    if (chunk < p.batch && (sm_count(&sms) != cudaSuccess ||
                            int64_t(chunk) * tiles(p.seq_q.seqlen, 128) * p.heads_q < sms / 2)) {
      cudaGetLastError();
      return false;
    }
    return fwd_supports_for<CacheKernelFor<ElementTag, kHeadDim>>(gathered_chunk<Element>(
               kvcache_as_forward(kp, nullptr, nullptr), 0, p.batch, nullptr, nullptr));
  }
  if (p.kv.page_table == nullptr && p.kv.batch_idx == nullptr && p.kv.cache_dim0 < p.batch) {
    return false;
  }
  return fwd_supports_for<CacheKernelFor<ElementTag, kHeadDim>>(
      kvcache_as_forward(kp, nullptr, nullptr));
}

template <class ElementTag, int kHeadDim> int fwd_kvcache_num_splits(const KvcacheParams&) {
  return 1;
}

// The workspace: the key counts, the rotated q (when rotary), the forward's own, then the
// gathered K and V of one chunk of sequences (Note [Gathered keys]).
struct KvcacheWorkspace {
  size_t lengths = 0, q = 0, forward = 0, gathered = 0;
  int chunk = 0;  // sequences per gather and forward
};

template <class ElementTag, int kHeadDim>
KvcacheWorkspace kvcache_workspace(const KvcacheParams& kp) {
  using Element = typename DeviceType<ElementTag>::type;
  auto round_up = [](size_t n) { return (n + 255) / 256 * 256; };
  const FwdParams& p = kp.fwd;
  KvcacheWorkspace w;
  w.lengths = round_up(size_t(p.batch) * sizeof(int));
  if (kp.rotary.cos != nullptr) {
    const int64_t rows = p.seq_q.cu_seqlens != nullptr ? int64_t(p.seq_q.total_rows)
                                                       : int64_t(p.batch) * p.seq_q.seqlen;
    w.q = round_up(size_t(rows) * p.heads_q * p.head_dim * 2);  // 16-bit elements
  }
  w.forward = round_up(
      fwd_workspace_bytes_for<CacheKernelFor<ElementTag, kHeadDim>>(
          kvcache_as_forward(kp, nullptr, nullptr)));
  constexpr int kBlockN = FwdTileConfig<kHeadDim>::kBlockN;
  w.chunk = gather_chunk<Element, kBlockN>(p);
  if (gathers_keys<kBlockN>(p.kv)) {
    w.gathered = 2 * round_up(gathered_bytes_per_seq<Element>(p) / 2 * size_t(w.chunk));
  }
  return w;
}

template <class ElementTag, int kHeadDim>
size_t fwd_kvcache_workspace_bytes(const KvcacheParams& kp) {
  const KvcacheWorkspace w = kvcache_workspace<ElementTag, kHeadDim>(kp);
  return w.lengths + w.q + w.forward + w.gathered;
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
  const FwdParams whole = kvcache_as_forward(kp, lengths, q_rot);
  if (!gathers_keys<FwdTileConfig<kHeadDim>::kBlockN>(kp.fwd.kv)) {
    return run_fwd_for<CacheKernelFor<ElementTag, kHeadDim>>(whole, forward_workspace, stream);
  }

  char* k_rows = base + w.lengths + w.q + w.forward;
  char* v_rows = k_rows + w.gathered / 2;
  GatherArgs g;
  g.k_cache = kp.fwd.k;
  g.v_cache = kp.fwd.v;
  g.kv = kp.fwd.kv;
  g.k_out = k_rows;
  g.v_out = v_rows;
  g.heads_kv = kp.fwd.heads_kv;
  g.head_dim = kp.fwd.head_dim;
  for (int first = 0; first < kp.fwd.batch; first += w.chunk) {
    const int count = std::min(w.chunk, kp.fwd.batch - first);
    g.first = first;
    const dim3 grid(tiles(kp.fwd.kv.capacity, kGatherRows), unsigned(count));
    if (grid.x > 0) gather_kv_kernel<Element><<<grid, kGatherThreads, 0, stream>>>(g);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    err = run_fwd_for<CacheKernelFor<ElementTag, kHeadDim>>(
        gathered_chunk<Element>(whole, first, count, k_rows, v_rows), forward_workspace, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace flash_cuda::sm90
