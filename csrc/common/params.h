// Plain-C++ descriptions of one attention problem, the contract between the op layer (which
// builds them from tensors) and the kernels (which read them).  No torch and no CUDA types here.
#pragma once

#include <cstdint>

namespace flash_cuda {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };
enum class ArchFamily : int { kSm80 = 0, kSm90 = 1 };

// One (batch, row, head, dim) tensor whose last dim is contiguous.  For a packed (varlen)
// tensor batch_stride is 0 and rows are addressed by the packed offset from SeqArgs.
struct TensorRef {
  void* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
};

// Per-row float32 statistics (lse, rowsum(dO*O)): element (b, h, packed_row) at
// ptr[b * batch_stride + h * head_stride + packed_row].
struct RowStatsRef {
  float* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t head_stride = 0;
};

// Where each sequence's rows live and how many are used.  Dense: cu_seqlens == nullptr and every
// sequence has `seqlen` rows.  Varlen: rows cu_seqlens[b] .. cu_seqlens[b+1] of the packed
// tensor.  seqused (optional, either mode) caps the rows that take part.
struct SeqArgs {
  const int* cu_seqlens = nullptr;
  const int* seqused = nullptr;
  int seqlen = 0;      // dense: the seqlen dimension; varlen: max_seqlen (sizes the grid)
  int total_rows = 0;  // varlen: rows of the packed tensor; cu_seqlens are clamped to it
};

// Attention over a KV cache (the kvcache forward kernels only; FwdParams::k / v then describe
// the cache: batch_stride is the stride of its dimension 0, a cache row or a page).  Sequence b
// attends to its cache rows [leftpad[b], cache_seqlens[b] + new rows of b), which live in cache
// row batch_idx[b] (else b) of a dense cache, or, paged, row r in page
// page_table[b * pages_per_seq + r / page_size] at offset r % page_size.  The GPU holds these
// values, so the kernels clamp them rather than trust them: rows to the cache's capacity, pages
// to [0, cache_dim0).
struct KvCacheArgs {
  const int* cache_seqlens = nullptr;   // rows in the cache before this call's new ones
  const int* cu_seqlens_new = nullptr;  // packed new keys: b's count is cu[b + 1] - cu[b]
  int new_rows = 0;                     // dense new keys: each sequence's count
  const int* leftpad = nullptr;
  const int* batch_idx = nullptr;   // dense caches
  const int* page_table = nullptr;  // paged caches
  int pages_per_seq = 0;            // the page table's row stride
  int page_size = 0;                // paged: rows per page
  int cache_dim0 = 0;               // the cache's dimension 0: cache rows, or pages
  int capacity = 0;                 // rows a sequence may hold (dense: the cache's seqlen)
};

// Split-KV partial results (num_splits > 1): split s of a block's visible key tiles writes its
// float32 O, normalised over its own keys, to o[s, b, row, h, :] and its lse to lse[s, b, row, h]
// (-inf where its rows saw none of its keys), for a combine kernel to merge.
struct SplitArgs {
  int num_splits = 1;
  float* o = nullptr;
  int64_t o_split_stride = 0, o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;
  float* lse = nullptr;
  int64_t lse_split_stride = 0, lse_batch_stride = 0, lse_row_stride = 0, lse_head_stride = 0;
};

struct FwdParams {
  TensorRef q, k, v, o;
  RowStatsRef lse;
  SeqArgs seq_q, seq_k;
  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;
  int head_dim = 0;  // the actual one; the kernel's may be larger
  float softmax_scale = 0.f;
  int window_left = -1;  // -1: unbounded; causal is window_right == 0
  int window_right = -1;
  // The block order's heads per group, log2; set by the launcher (Note [Block order] in
  // common/tile_order.cuh).  A launch detail: in BwdParams::fwd it orders the key tiles.
  int block_shift = 0;
  KvCacheArgs kv;     // read by the kvcache kernels only
  SplitArgs split;    // the same

  // Whether a causal or local mask gives the tiles different amounts of work.
  bool masked() const { return window_left >= 0 || window_right >= 0; }
};


// Rotary embedding of a KV-cache call (flash_cuda/reference_kvcache.py states the rule).
struct RotaryArgs {
  // (rows, rotary_dim / 2) tables, float32 or q's own 16-bit type, rows `row_stride` elements
  // apart with a unit last stride (cos and sin alike); null: no rotary.
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t row_stride = 0;
  bool float_table = true;     // float32 elements, else q's type
  int rows = 0;
  int rotary_dim = 0;          // a multiple of 16, <= head_dim
  bool interleaved = true;     // pairs (0, 1), (2, 3), ...; else (i, i + rotary_dim / 2)
  const int* start = nullptr;  // rotary_seqlens: a sequence's first new position (else
                               // cache_seqlens)
  bool advance = false;        // causal or local: query row i at start + i, else all at start
};

// One call of attention over a KV cache: fwd.q / o / lse and the problem as FwdParams holds
// them, fwd.k / v the caches and fwd.kv where each sequence's rows are; the new keys and
// values (null when none) go into the caches first, rotated with q when rotary.cos is set.
struct KvcacheParams {
  FwdParams fwd;
  TensorRef k_new, v_new;  // dense (batch, new rows, heads_kv, d) or packed (kv.cu_seqlens_new)
  int k_new_total_rows = 0;  // packed: k_new's rows (a bound on any sequence's)
  RotaryArgs rotary;
};

// What the combine reads and writes: the rows of each sequence of q (seq_q, as the attention
// saw them; rows outside every sequence keep what the op layer put there), their partials in
// `split` and their output in o / lse, the forward's FwdParams' layouts.
struct CombineArgs {
  SplitArgs split;
  TensorRef o;
  RowStatsRef lse;
  SeqArgs seq_q;
  int heads = 0;
  int head_dim = 0;
};

struct BwdParams {
  FwdParams fwd;  // q, k, v, o, lse and the problem as the forward saw it
  TensorRef dout;
  TensorRef dq;                 // the output, q's layout
  // dq_accum and dot_do_o live in the workspace the family's launcher lays out (the caller
  // allocates bwd_workspace_bytes and never learns the layout).
  TensorRef dq_accum;           // float32 dQ accumulator, in the family's own layout
  int64_t dq_accum_floats = 0;  // its size; the preprocess kernel zeroes it
  TensorRef dk, dv;             // heads_q heads when heads_q != heads_kv (summed by the caller)
  RowStatsRef dot_do_o;         // float32 rowsum(dO * O), written by the preprocess kernel
  // dense: batch * seqlen_q; varlen: total_q (rows the preprocess visits)
  int64_t total_rows_q = 0;
};

}  // namespace flash_cuda
