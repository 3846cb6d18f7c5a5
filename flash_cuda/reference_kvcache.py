"""Plain-PyTorch reference for attention over a KV cache (FlashAttention-3's
`flash_attn_with_kvcache` semantics): the oracle of the KV-cache kernels and the CPU path.

One call, per sequence b of the batch:
1. New keys and values (`k`, `v`: dense (batch, seqlen_new, heads_kv, d), or packed
   (total_new, heads_kv, d) with `cu_seqlens_k_new`) are written in place into the cache at rows
   cache_seqlens[b] .. cache_seqlens[b] + n - 1 of its cache row (`cache_batch_idx[b]`, else b),
   after rotary embedding when `rotary_cos` / `rotary_sin` are given.
2. The cache is dense (batch_cache, seqlen_cache, heads_kv, d), or paged (num_pages, page_size,
   heads_kv, d) with `page_table` (batch, pages per sequence): row r of sequence b lives in page
   page_table[b, r // page_size] at offset r % page_size, for any page size >= 1.
3. q (dense (batch, seqlen_q, heads, d), or packed with `cu_seqlens_q`) attends to cache rows
   cache_leftpad[b] .. cache_seqlens[b] + n - 1 (the leftpad rows are not part of the
   sequence), with the bottom-right aligned causal / window mask of attention_forward_reference,
   and GQA / MQA.
Split-KV: `split_partials_reference` gives each split of the keys' normalised output and lse
(the mask of the whole sequence applied), and `combine_reference` merges them by their lse into
the unsplit result: the oracles of the split-KV kernels and of their combine.

Rotary (half the rotary dim in `rotary_cos`'s last axis; interleaved pairs (0, 1), (2, 3), ...
or, with rotary_interleaved=False, halves (i, i + rotary_dim / 2)) rotates new key i at position
p0 + i and the queries at p0 + i when causal or local, all at p0 otherwise, where p0 is
rotary_seqlens[b] when given, else cache_seqlens[b] (cache rows, leftpad included), as
FlashAttention-3 counts them.  Rotation runs in float32 and rounds once to the input dtype.
"""

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .reference import (_masked_scores, _merge_q_heads, _resolve_window, _split_kv_heads,
                        _split_q_heads, attention_forward_reference)

__all__ = ["apply_rotary", "combine_reference", "kvcache_forward_reference",
           "split_partials_reference"]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                 interleaved: bool) -> Tensor:
    """x (n, heads, d) rotated in its first 2 * cos.shape[-1] dims at `positions` (n,)."""
    rotary_dim = 2 * cos.shape[-1]
    c = cos[positions].float().unsqueeze(1)  # (n, 1, rotary_dim / 2)
    s = sin[positions].float().unsqueeze(1)
    xr = x[..., :rotary_dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :rotary_dim // 2], xr[..., rotary_dim // 2:]
        rotated = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def _per_batch(value: Optional[Union[int, Tensor]], batch: int, name: str) -> Optional[list]:
    if value is None:
        return None
    if isinstance(value, int):
        return [value] * batch
    values = [int(v) for v in value.tolist()]
    if len(values) != batch:
        raise ValueError(f"{name} must have one entry per sequence ({batch}); got {len(values)}")
    return values


def _rows(q_or_k: Tensor, cu: Optional[list], b: int) -> Tensor:
    """Sequence b's rows, (n, heads, d), of a dense (batch, n, heads, d) or packed tensor."""
    return q_or_k[b] if cu is None else q_or_k[cu[b]:cu[b + 1]]


class _Cache:
    """Row r of sequence b of a dense or paged cache, as an index into the cache tensor."""

    def __init__(self, k_cache: Tensor, page_table: Optional[Tensor],
                 cache_batch_idx: Optional[list]):
        self.paged = page_table is not None
        if self.paged:
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx selects rows of a dense cache; with a "
                                 "page_table the table already maps sequences to pages")
            self.pages = [[int(p) for p in row] for row in page_table.tolist()]
            self.page_size = k_cache.shape[1]
            self.capacity = page_table.shape[1] * self.page_size
        else:
            self.batch_idx = cache_batch_idx
            self.capacity = k_cache.shape[1]
        self.num_rows = k_cache.shape[0]

    def index(self, b: int, rows: range) -> Tuple[Tensor, Tensor]:
        """(first, second) index tensors of cache rows `rows` of sequence b."""
        if self.paged:
            pages = [self.pages[b][r // self.page_size] for r in rows]
            if any(not 0 <= p < self.num_rows for p in pages):
                raise ValueError(f"page_table[{b}] names a page outside [0, {self.num_rows})")
            return (torch.tensor(pages, dtype=torch.long),
                    torch.tensor([r % self.page_size for r in rows], dtype=torch.long))
        row = b if self.batch_idx is None else self.batch_idx[b]
        if not 0 <= row < self.num_rows:
            raise ValueError(f"cache_batch_idx[{b}] = {row} is outside [0, {self.num_rows})")
        return (torch.full((len(rows),), row, dtype=torch.long),
                torch.tensor(list(rows), dtype=torch.long))


def kvcache_forward_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Optional[Tensor] = None,
    v: Optional[Tensor] = None,
    rotary_cos: Optional[Tensor] = None,
    rotary_sin: Optional[Tensor] = None,
    cache_seqlens: Optional[Union[int, Tensor]] = None,
    cache_batch_idx: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    page_table: Optional[Tensor] = None,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k_new: Optional[Tensor] = None,
    rotary_seqlens: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    rotary_interleaved: bool = True,
    upcast: bool = True,
) -> Tuple[Tensor, Tensor]:
    """(out like q, lse (batch, heads, seqlen_q) or, packed, (heads, total_q)); k_cache and
    v_cache are updated in place when k and v are given.  See the module docstring."""
    if (k is None) != (v is None):
        raise ValueError("k and v go together: pass both (append to the cache) or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin go together")
    if rotary_cos is not None and k is None:
        raise ValueError("rotary_cos / rotary_sin rotate the new keys: pass k and v too")
    cu_q = None if cu_seqlens_q is None else [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = None if cu_seqlens_k_new is None else [int(x) for x in cu_seqlens_k_new.tolist()]
    batch = q.shape[0] if cu_q is None else len(cu_q) - 1
    cache = _Cache(k_cache, page_table, _per_batch(cache_batch_idx, batch, "cache_batch_idx"))
    lengths = _per_batch(cache_seqlens, batch, "cache_seqlens")
    if lengths is None:
        if k is not None:
            raise ValueError("cache_seqlens (where the new keys go) is required with k and v")
        lengths = [cache.capacity] * batch
    leftpad = _per_batch(cache_leftpad, batch, "cache_leftpad") or [0] * batch
    rotary_start = _per_batch(rotary_seqlens, batch, "rotary_seqlens")
    local = causal or window_size != (-1, -1)

    out = torch.zeros_like(q)
    heads = q.shape[-2]
    lse = (q.new_full((batch, heads, q.shape[1]), float("-inf"), dtype=torch.float32)
           if cu_q is None else q.new_full((heads, q.shape[0]), float("-inf"),
                                          dtype=torch.float32))
    for b in range(batch):
        q_b = _rows(q, cu_q, b)
        n_new = 0 if k is None else _rows(k, cu_k, b).shape[0]
        end = lengths[b] + n_new
        if not 0 <= leftpad[b] <= lengths[b] or end > cache.capacity:
            raise ValueError(f"sequence {b}: cache rows [{leftpad[b]}, {end}) do not fit "
                             f"the cache's {cache.capacity} rows")
        if k is not None:
            k_new, v_new = _rows(k, cu_k, b), _rows(v, cu_k, b)
            p0 = lengths[b] if rotary_start is None else rotary_start[b]
            if rotary_cos is not None:
                k_new = apply_rotary(k_new, rotary_cos, rotary_sin,
                                     torch.arange(p0, p0 + n_new), rotary_interleaved)
                q_pos = (torch.arange(p0, p0 + q_b.shape[0]) if local
                         else torch.full((q_b.shape[0],), p0, dtype=torch.long))
                q_b = apply_rotary(q_b, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
            i0, i1 = cache.index(b, range(lengths[b], end))
            k_cache[i0, i1] = k_new.to(k_cache.dtype)
            v_cache[i0, i1] = v_new.to(v_cache.dtype)
        i0, i1 = cache.index(b, range(leftpad[b], end))
        o_b, lse_b = attention_forward_reference(
            q_b.unsqueeze(0), k_cache[i0, i1].unsqueeze(0), v_cache[i0, i1].unsqueeze(0),
            softmax_scale=softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5,
            causal=causal, window_left=window_size[0], window_right=window_size[1],
            upcast=upcast)
        if cu_q is None:
            out[b], lse[b] = o_b[0].to(out.dtype), lse_b[0]
        else:
            out[cu_q[b]:cu_q[b + 1]] = o_b[0].to(out.dtype)
            lse[:, cu_q[b]:cu_q[b + 1]] = lse_b[0]
    return out, lse


def split_partials_reference(q: Tensor, k: Tensor, v: Tensor, boundaries, softmax_scale: float,
                             causal: bool = False,
                             window_size: Tuple[int, int] = (-1, -1)) -> Tuple[Tensor, Tensor]:
    """The keys of dense q (b, Lq, heads, d), k, v (b, Lk, heads_kv, d) cut at `boundaries`
    (0 = c0 <= c1 <= ... <= cS = Lk): per split, float32 out (S, b, Lq, heads, d) normalised
    within the split and lse (S, b, Lq, heads), with the bottom-right mask of the whole
    sequence.  A split a row sees nothing of (empty, or masked) has out 0 and lse -inf there."""
    window = _resolve_window(causal, window_size[0], window_size[1])
    q_len, k_len, heads_kv = q.shape[1], k.shape[1], k.shape[2]
    if boundaries[0] != 0 or boundaries[-1] != k_len or list(boundaries) != sorted(boundaries):
        raise ValueError(f"boundaries must rise from 0 to the key length {k_len}; got "
                         f"{list(boundaries)}")
    qh = _split_q_heads(q, heads_kv, torch.float32)  # (b, hkv, g, Lq, d)
    kh, vh = _split_kv_heads(k, torch.float32), _split_kv_heads(v, torch.float32)
    outs, lses = [], []
    for k0, k1 in zip(boundaries[:-1], boundaries[1:]):
        if k1 == k0:
            o = torch.zeros_like(qh)
            lse = qh.new_full(qh.shape[:-1], float("-inf"))
        else:
            scores = _masked_scores(qh, kh[..., k0:k1, :], softmax_scale, q_len, k_len, k0,
                                    window)
            row_max = scores.amax(dim=-1, keepdim=True)
            safe = torch.where(torch.isneginf(row_max), 0.0, row_max)
            p = torch.exp(scores - safe)
            row_sum = p.sum(dim=-1, keepdim=True)
            seen = row_sum > 0
            o = torch.matmul(p, vh[..., k0:k1, :]) / torch.where(seen, row_sum, 1.0)
            lse = torch.where(seen, safe + torch.log(torch.where(seen, row_sum, 1.0)),
                              float("-inf")).squeeze(-1)
        outs.append(_merge_q_heads(o))
        lses.append(_merge_q_heads(lse.unsqueeze(-1)).squeeze(-1))  # (b, Lq, heads)
    return torch.stack(outs), torch.stack(lses)


def combine_reference(out_partial: Tensor, lse_partial: Tensor,
                      out_dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """Merges split partials: out_partial (S, *rows, d), lse_partial (S, *rows) in the same row
    order -> out (*rows, d) in out_dtype (default out_partial's), lse (*rows) float32.  Each
    split weighs exp(lse_s - lse); a split with lse -inf weighs 0 whatever its out holds, and a
    row no split saw gets out 0, lse -inf."""
    if lse_partial.shape != out_partial.shape[:-1]:
        raise ValueError(f"lse_partial must have out_partial's shape without its last dimension "
                         f"({tuple(out_partial.shape[:-1])}); got {tuple(lse_partial.shape)}")
    lse_s = lse_partial.float()
    top = lse_s.amax(dim=0)
    safe = torch.where(torch.isneginf(top), 0.0, top)
    weight = torch.exp(lse_s - safe)  # (S, *rows), 0 for lse -inf
    total = weight.sum(dim=0)
    seen = total > 0
    lse = torch.where(seen, safe + torch.log(torch.where(seen, total, 1.0)), float("-inf"))
    weighted = torch.where(weight.unsqueeze(-1) > 0, weight.unsqueeze(-1) * out_partial.float(),
                           0.0)
    out = weighted.sum(dim=0) / torch.where(seen, total, 1.0).unsqueeze(-1)
    return out.to(out_dtype or out_partial.dtype), lse
