// GQA packing of a decode step (host side, no device code): with one query row per sequence, a
// group's query heads become the rows of one tile, so that a block reads each key and value once
// for the whole group instead of once per query head.  It is a view of the problem's tensors:
// q, out and lse are seen as (batch, group rows, heads_kv), which needs lse's rows of one head
// to be adjacent (its head stride 1, as seqlen_q = 1 makes it in the op layer's layout).  With
// one query row the causal / right-window bound excludes no key (the row sits on the last key's
// diagonal), so the packed view has no mask; a left window would depend on the row, so it is
// not packed.
#pragma once

#include "common/params.h"

namespace flash_cuda {

inline bool packs_gqa(const FwdParams& p) {
  // seqused_q would cap the packed rows (the group's heads) instead of the query rows.
  return p.seq_q.cu_seqlens == nullptr && p.seq_q.seqused == nullptr && p.seq_q.seqlen == 1 &&
         p.heads_q > p.heads_kv && p.heads_kv > 0 && p.window_left < 0 &&
         p.lse.head_stride == 1;
}

inline FwdParams packed_view(const FwdParams& p) {
  if (!packs_gqa(p)) return p;
  const int group = p.heads_q / p.heads_kv;
  FwdParams v = p;
  for (TensorRef* t : {&v.q, &v.o}) {
    t->row_stride = t->head_stride;
    t->head_stride *= group;
  }
  v.lse.head_stride = group;  // a head's rows are the group's heads, 1 apart
  v.seq_q.seqlen = group;
  v.heads_q = p.heads_kv;
  v.window_right = -1;
  return v;
}

}  // namespace flash_cuda
