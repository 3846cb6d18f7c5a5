"""Plain-PyTorch reference for flash_cuda's forward and backward attention.

It defines the semantics the kernels must reproduce (layouts, seqused, bottom-right-aligned
causal/local masks, GQA, empty rows) and serves as the CPU implementation of the ops. It is
correct but not fast: it walks over key chunks with an online softmax so memory stays linear in
sequence length, and it loops over variable-length sequences in Python.
"""

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

__all__ = [
    "output_like",
    "attention_forward_reference",
    "attention_backward_reference",
    "attention_naive",
    "visible_mask",
]


class _Span(NamedTuple):
    """Index tuples selecting one batch of equal-length sequences as (batch, len, heads, d)."""

    q_index: tuple
    k_index: tuple

    @property
    def lse_index(self) -> tuple:
        # lse keeps heads before the sequence axis in both layouts: (b, h, s) and (h, total).
        return (self.q_index[0], slice(None), self.q_index[1])


def _resolve_window(causal: bool, window_left: int, window_right: int) -> Tuple[int, int]:
    """Folds causal into the window: causal is a window with window_right = 0."""
    return window_left, (0 if causal else window_right)


def visible_mask(
    q_len: int, k_len: int, k_start: int, k_end: int, window: Tuple[int, int], device
) -> Tensor:
    """Boolean (q_len, k_end - k_start): query row i sees key j of [k_start, k_end).

    k_end <= k_len, so only the window bounds remain to be applied.
    """
    window_left, window_right = window
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_start, k_end, device=device).unsqueeze(0)
    # Bottom-right alignment: the last query row lines up with the last key.
    diagonal = rows + (k_len - q_len)
    mask = torch.ones(q_len, k_end - k_start, dtype=torch.bool, device=device)
    if window_left >= 0:
        mask = mask & (cols >= diagonal - window_left)
    if window_right >= 0:
        mask = mask & (cols <= diagonal + window_right)
    return mask


def _key_range(q_len: int, k_len: int, window: Tuple[int, int]) -> Tuple[int, int]:
    """Half-open key range seen by at least one query row; chunks outside it are skipped.

    The last row always sees the last key (its window is centred there), so only the left end
    can move: row 0 has the leftmost window.
    """
    if q_len == 0 or k_len == 0:
        return 0, 0
    window_left = window[0]
    lo = max(0, k_len - q_len - window_left) if window_left >= 0 else 0
    return lo, k_len


def _chunk_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """S = scale * q k^T for one key chunk; a named seam so tests can watch the score shapes."""
    return torch.matmul(q, k.transpose(-1, -2)) * scale


def _masked_scores(qh: Tensor, kc: Tensor, scale: float, q_len, k_len, k0, window) -> Tensor:
    """Scores of one key chunk with invisible entries set to -inf."""
    mask = visible_mask(q_len, k_len, k0, k0 + kc.shape[-2], window, qh.device)
    return _chunk_scores(qh, kc, scale).masked_fill(~mask, float("-inf"))


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32) if upcast else dtype


def _split_q_heads(x: Tensor, heads_kv: int, dtype: torch.dtype) -> Tensor:
    """(b, s, heads_q, d) -> (b, heads_kv, group, s, d): query head h = kv_head * group + g."""
    b, s, heads_q, d = x.shape
    return x.to(dtype).reshape(b, s, heads_kv, heads_q // heads_kv, d).permute(0, 2, 3, 1, 4)


def _merge_q_heads(x: Tensor) -> Tensor:
    """Inverse of _split_q_heads: (b, heads_kv, group, s, d) -> (b, s, heads_q, d)."""
    b, heads_kv, group, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, heads_kv * group, d)


def _split_kv_heads(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(b, s, heads_kv, d) -> (b, heads_kv, 1, s, d); the 1 broadcasts over the query group."""
    return x.to(dtype).permute(0, 2, 1, 3).unsqueeze(2)


def _forward_sequence(q, k, v, scale, window, upcast, chunk_size) -> Tuple[Tensor, Tensor]:
    """Online-softmax forward over key chunks for sequences of one length.

    q (b, Lq, heads_q, d), k/v (b, Lk, heads_kv, d) -> out (b, Lq, heads_q, d) in the compute
    dtype, lse (b, heads_q, Lq) float32.
    """
    dtype = _compute_dtype(q.dtype, upcast)
    q_len, k_len, heads_kv = q.shape[1], k.shape[1], k.shape[2]
    qh = _split_q_heads(q, heads_kv, dtype)  # (b, hkv, g, Lq, d)
    kh, vh = _split_kv_heads(k, dtype), _split_kv_heads(v, dtype)  # (b, hkv, 1, Lk, d)
    row_max = torch.full(qh.shape[:-1], float("-inf"), dtype=dtype, device=q.device)
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros(*qh.shape[:-1], vh.shape[-1], dtype=dtype, device=q.device)
    lo, hi = _key_range(q_len, k_len, window)
    for k0 in range(lo, hi, chunk_size):
        k1 = min(k0 + chunk_size, hi)
        s = _masked_scores(qh, kh[..., k0:k1, :], scale, q_len, k_len, k0, window)
        new_max = torch.maximum(row_max, s.amax(dim=-1))
        # A row that has seen no key yet keeps max -inf; subtracting 0 instead keeps exp at 0
        # rather than exp(-inf - -inf) = NaN.
        safe_max = torch.where(torch.isneginf(new_max), 0.0, new_max)
        p = torch.exp(s - safe_max.unsqueeze(-1))
        rescale = torch.exp(row_max - safe_max)
        row_sum = row_sum * rescale + p.sum(dim=-1)
        acc = acc * rescale.unsqueeze(-1) + torch.matmul(p, vh[..., k0:k1, :])
        row_max = new_max
    has_key = row_sum > 0
    out = acc / torch.where(has_key, row_sum, 1.0).unsqueeze(-1)
    lse = torch.where(has_key, row_max.float() + torch.log(row_sum.float()), float("-inf"))
    return _merge_q_heads(out), lse.flatten(1, 2)


def _backward_sequence(dout, q, k, v, out, lse, scale, window, upcast, chunk_size):
    """Backward over key chunks, recomputing P = exp(S - lse) per chunk.

    Shapes as in _forward_sequence; returns dq, dk, dv in the compute dtype. dk/dv of a kv head
    sum the contributions of every query head in its group.
    """
    dtype = _compute_dtype(q.dtype, upcast)
    q_len, k_len, heads_kv = q.shape[1], k.shape[1], k.shape[2]
    qh, doh = _split_q_heads(q, heads_kv, dtype), _split_q_heads(dout, heads_kv, dtype)
    kh, vh = _split_kv_heads(k, dtype), _split_kv_heads(v, dtype)
    delta = (doh * _split_q_heads(out, heads_kv, dtype)).sum(dim=-1, keepdim=True)
    lse = lse.reshape(qh.shape[:-1]).unsqueeze(-1)
    # Rows without a visible key have lse = -inf and all-masked scores; +inf makes their P
    # exp(-inf) = 0 instead of exp(-inf - -inf) = NaN.
    lse = torch.where(torch.isneginf(lse), float("inf"), lse).to(dtype)
    dq = torch.zeros_like(qh)
    dk = torch.zeros_like(kh.squeeze(2))  # (b, hkv, Lk, d)
    dv = torch.zeros_like(vh.squeeze(2))
    lo, hi = _key_range(q_len, k_len, window)
    for k0 in range(lo, hi, chunk_size):
        k1 = min(k0 + chunk_size, hi)
        kc, vc = kh[..., k0:k1, :], vh[..., k0:k1, :]
        p = torch.exp(_masked_scores(qh, kc, scale, q_len, k_len, k0, window) - lse)
        dv[..., k0:k1, :] = torch.matmul(p.transpose(-1, -2), doh).sum(dim=2)
        ds = p * (torch.matmul(doh, vc.transpose(-1, -2)) - delta)
        dq += torch.matmul(ds, kc) * scale
        dk[..., k0:k1, :] = torch.matmul(ds.transpose(-1, -2), qh).sum(dim=2) * scale
    return _merge_q_heads(dq), dk.transpose(1, 2), dv.transpose(1, 2)


def _host_list(t: Optional[Tensor]) -> Optional[list]:
    return None if t is None else [int(x) for x in t.tolist()]


def _used_length(used: Optional[list], b: int, length: int, name: str) -> int:
    if used is None:
        return length
    if not 0 <= used[b] <= length:
        raise ValueError(f"{name}[{b}] = {used[b]} must lie in [0, {length}], the length of "
                         f"sequence {b}.")
    return used[b]


def _sequence_spans(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k) -> list:
    """Splits the problem into spans of equal-length sequences, one per sequence if needed."""
    used_q, used_k = _host_list(seqused_q), _host_list(seqused_k)
    if cu_seqlens_q is None:
        if used_q is None and used_k is None:
            return [_Span((slice(None), slice(None)), (slice(None), slice(None)))]
        spans = []
        for b in range(q.shape[0]):
            q_len = _used_length(used_q, b, q.shape[1], "seqused_q")
            k_len = _used_length(used_k, b, k.shape[1], "seqused_k")
            spans.append(_Span((slice(b, b + 1), slice(0, q_len)),
                               (slice(b, b + 1), slice(0, k_len))))
        return spans
    cu_q, cu_k = _host_list(cu_seqlens_q), _host_list(cu_seqlens_k)
    spans = []
    for b in range(len(cu_q) - 1):
        q_len = _used_length(used_q, b, cu_q[b + 1] - cu_q[b], "seqused_q")
        k_len = _used_length(used_k, b, cu_k[b + 1] - cu_k[b], "seqused_k")
        # A leading None turns the (len, heads, d) slice into a batch of one.
        spans.append(_Span((None, slice(cu_q[b], cu_q[b] + q_len)),
                           (None, slice(cu_k[b], cu_k[b] + k_len))))
    return spans


def _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, chunk_size) -> None:
    """The op rules on the tensors' shapes (flash_cuda/_checks.py), for direct callers of the
    reference; the ops check them in full before calling it."""
    from flash_cuda import _checks  # plain Python over torch, like this module
    _checks.check_qkv(q, k, v, _checks.check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k))
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}.")


def output_like(t: Tensor, zeroed: bool = False) -> Tensor:
    """A new tensor for the output that mirrors `t` (out and dq mirror q, dk k, dv v), laid out
    by empty_like when t's last dim is contiguous (t's strides for a dense t, its order of
    dimensions otherwise), else contiguous. The CUDA kernels allocate the same way
    (Note [Output layout] in csrc/ops/attention_cuda.cpp)."""
    new = torch.empty_like(t) if t.stride(-1) == 1 else t.new_empty(t.shape)
    return new.zero_() if zeroed else new


def _default_scale(q: Tensor, softmax_scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _lse_shape(q: Tensor, varlen: bool) -> tuple:
    """Dense: (batch, heads_q, seqlen_q); varlen: (heads_q, total_q)."""
    return (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])


def attention_forward_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    upcast: bool = True,
    chunk_size: int = 1024,
) -> Tuple[Tensor, Tensor]:
    """Attention forward; returns (out like q, softmax_lse float32).

    upcast=True accumulates in float32 (the accuracy target); upcast=False computes in the input
    dtype, modelling a plain low-precision attention to calibrate test tolerances.
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, chunk_size)
    scale = _default_scale(q, softmax_scale)
    window = _resolve_window(causal, window_left, window_right)
    spans = _sequence_spans(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    # Rows no span covers (past seqused_q or cu_seqlens_q[-1]) keep out = 0 and lse = -inf.
    out = output_like(q, zeroed=True)
    lse_shape = _lse_shape(q, cu_seqlens_q is not None)
    lse = torch.full(lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
    for span in spans:
        k_span, v_span = k[span.k_index], v[span.k_index]
        o, l = _forward_sequence(q[span.q_index], k_span, v_span, scale, window, upcast,
                                 chunk_size)
        out[span.q_index] = o.to(q.dtype)
        lse[span.lse_index] = l
    return out, lse


def attention_backward_reference(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Optional[Tensor] = None,
    cu_seqlens_k: Optional[Tensor] = None,
    seqused_q: Optional[Tensor] = None,
    seqused_k: Optional[Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    upcast: bool = True,
    chunk_size: int = 1024,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Attention backward from the forward's out and lse; returns (dq, dk, dv) like q, k, v."""
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, chunk_size)
    scale = _default_scale(q, softmax_scale)
    window = _resolve_window(causal, window_left, window_right)
    spans = _sequence_spans(q, k, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    # Tokens no span covers take no part in attention, so their gradients stay 0.
    dq, dk, dv = (output_like(t, zeroed=True) for t in (q, k, v))
    for span in spans:
        qi, ki = span.q_index, span.k_index
        grads = _backward_sequence(dout[qi], q[qi], k[ki], v[ki], out[qi], lse[span.lse_index],
                                   scale, window, upcast, chunk_size)
        dq[qi], dk[ki], dv[ki] = (g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
    return dq, dk, dv


def attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
) -> Tuple[Tensor, Tensor]:
    """Dense float64 attention materialising every score; the oracle for small tests.

    Returns (out (b, Lq, heads_q, d), lse (b, heads_q, Lq)) in float64, differentiable by
    autograd, with out = 0 and lse = -inf on rows that see no key.
    """
    scale = _default_scale(q, softmax_scale)
    group = q.shape[2] // k.shape[2]
    q64 = q.double().transpose(1, 2)  # (b, hq, Lq, d)
    k64 = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
    v64 = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    q_len, k_len = q.shape[1], k.shape[1]
    # Written straight from the definition (offset of key j from row i's diagonal), apart from
    # visible_mask, so that the oracle checks the reference's mask too.
    offset = (torch.arange(k_len).view(1, -1) - torch.arange(q_len).view(-1, 1)
              - (k_len - q_len)).to(q.device)
    right = 0 if causal else window_right
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
    if window_left >= 0:
        visible &= offset >= -window_left
    if right >= 0:
        visible &= offset <= right
    scores = torch.matmul(q64, k64.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isneginf(row_max), 0.0, row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    has_key = row_sum > 0
    out = torch.matmul(p, v64) / torch.where(has_key, row_sum, 1.0)
    lse = torch.where(has_key, row_max + torch.log(torch.where(has_key, row_sum, 1.0)),
                      float("-inf"))
    return out.transpose(1, 2), lse.squeeze(-1)
