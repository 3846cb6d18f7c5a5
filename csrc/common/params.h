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

  // Whether a causal or local mask gives the tiles different amounts of work.
  bool masked() const { return window_left >= 0 || window_right >= 0; }
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
