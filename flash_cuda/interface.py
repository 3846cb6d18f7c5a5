"""The user API: FlashAttention-3 compatible attention functions over torch.ops.flash_cuda.

Layouts. Dense: q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv,
head_dim); out like q; softmax_lse float32 (batch, heads_q, seqlen_q). Varlen: sequences packed
along dimension 0, q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim),
cu_seqlens_* int32 (batch + 1,) prefix sums of the lengths; softmax_lse (heads_q, total_q).
Only the last dimension must be contiguous; any other strides are read in place.

Semantics. softmax(softmax_scale * q k^T) v with softmax_scale defaulting to head_dim ** -0.5.
Masks are aligned bottom-right, as in FlashAttention: with Lq / Lk the query / key lengths of a
sequence, row i sees key j iff j >= i + Lk - Lq - window_left (when window_left >= 0) and
j <= i + Lk - Lq + window_right (when window_right >= 0); both bounds are inclusive and
causal=True means window_right = 0. A row that sees no key gets out = 0 and lse = -inf, and
no gradient. heads_q may be any multiple of heads_kv (GQA / MQA).

CUDA tensors run the compiled kernels (float16 / bfloat16). CPU tensors run the plain-PyTorch
reference (float16 / bfloat16 / float32): correct, with float32 accumulation, but not fast.
num_splits, pack_gqa and sm_margin are performance hints that never change results; they are
validated and otherwise ignored. dropout_p and alibi_slopes are accepted for FlashAttention-2
keyword compatibility, with only their defaults supported. deterministic=True asks for a
reproducible backward: the CPU reference always is one; a CUDA build whose backward is not
(build_info()["features"]["deterministic_backward"]) rejects it at the call when gradients
will be needed.
"""

from typing import Optional

import torch

# Importing _ops also registers the CPU and fake kernels of the ops.
from flash_cuda import _checks, _ops

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
]


class _FlashAttnFunction(torch.autograd.Function):
    """Forward and backward through torch.ops.flash_cuda; dense when cu_seqlens_q is None."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                max_seqlen_k, softmax_scale, causal, window_left, window_right, deterministic):
        out, lse = torch.ops.flash_cuda.fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, causal, window_left, window_right)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q,
                              seqused_k)
        # max_seqlen may be a SymInt under torch.compile; it is kept as given.
        ctx.max_seqlen = (max_seqlen_q, max_seqlen_k)
        ctx.options = (softmax_scale, causal, window_left, window_right, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k, used_q, used_k = ctx.saved_tensors
        # Upstream gradients may come broadcast (stride 0) or transposed; the kernels need only
        # a contiguous last dimension, so copy only then.
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = torch.ops.flash_cuda.bwd(
            dout, q, k, v, out, lse, cu_q, cu_k, used_q, used_k, *ctx.max_seqlen, *ctx.options)
        # No gradient flows to the 11 arguments after q, k and v.
        return (dq, dk, dv) + (None,) * 11


def _check_options(softmax_scale, causal, window_size, deterministic, return_attn_probs,
                   hints, unsupported) -> None:
    _checks.check_softmax_scale(softmax_scale)
    _checks.check_flag("causal", causal)
    _checks.check_flag("deterministic", deterministic)
    _checks.check_flag("return_attn_probs", return_attn_probs)
    _checks.check_window_size(window_size)
    _checks.check_hints(**hints)
    _checks.check_unsupported(**unsupported)


def _unsupported(qv, q_descale, k_descale, v_descale, attention_chunk, softcap, dropout_p,
                 alibi_slopes, block_table=None) -> dict:
    """FlashAttention arguments without a flash_cuda implementation, as (value, default)."""
    return dict(qv=(qv, None), q_descale=(q_descale, None), k_descale=(k_descale, None),
                v_descale=(v_descale, None), attention_chunk=(attention_chunk, 0),
                softcap=(softcap, 0.0), dropout_p=(dropout_p, 0.0),
                alibi_slopes=(alibi_slopes, None), block_table=(block_table, None))


def _apply(q, k, v, varlen_args, softmax_scale, causal, window_size, deterministic,
           return_attn_probs):
    """Runs the autograd function on validated inputs; varlen_args is the 6-tuple or None."""
    _checks.check_deterministic_backward(deterministic, q, k, v,
                                         _ops.CUDA_DETERMINISTIC_BACKWARD)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    window_left, window_right = window_size
    if causal:
        window_right = 0
    if varlen_args is None:
        varlen_args = (None, None, None, None, q.shape[1], k.shape[1])
    out, lse = _FlashAttnFunction.apply(q, k, v, *varlen_args, softmax_scale, causal,
                                        window_left, window_right, deterministic)
    return (out, lse) if return_attn_probs else out


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False, *, dropout_p=0.0, alibi_slopes=None):
    """Dense attention: q (batch, seqlen_q, heads_q, d), k/v (batch, seqlen_k, heads_kv, d).

    Returns out like q, or (out, softmax_lse) with return_attn_probs=True, softmax_lse being
    float32 (batch, heads_q, seqlen_q). Masks are bottom-right aligned, windows inclusive,
    causal means window_size[1] = 0; rows that see no key give out 0 and lse -inf. On CPU the
    plain-PyTorch reference runs (correct, not fast). qv, the descales, attention_chunk,
    softcap, dropout_p and alibi_slopes are accepted only at their defaults; num_splits,
    pack_gqa and sm_margin are hints with no effect on results.
    """
    _checks.check_dense(q, k, v)
    _check_options(softmax_scale, causal, window_size, deterministic, return_attn_probs,
                   dict(num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin),
                   _unsupported(qv, q_descale, k_descale, v_descale, attention_chunk, softcap,
                                dropout_p, alibi_slopes))
    return _apply(q, k, v, None, softmax_scale, causal, window_size, deterministic,
                  return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, dropout_p=0.0, alibi_slopes=None,
                           block_table=None):
    """Attention over packed variable-length sequences.

    q (total_q, heads_q, d), k/v (total_k, heads_kv, d); sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q (int32, batch + 1 entries, starting at 0) and
    likewise for k/v. max_seqlen_q / max_seqlen_k (int or SymInt) must be at least the longest
    sequence. seqused_q / seqused_k (int32, (batch,)) optionally keep only the first
    seqused[b] rows of each sequence; the others get out 0, lse -inf and zero gradients.
    Returns out like q, or (out, softmax_lse) with softmax_lse float32 (heads_q, total_q).
    Masks, defaults and unsupported arguments are as in flash_attn_func; on CPU the reference
    runs (correct, not fast).
    """
    _checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         seqused_q, seqused_k)
    _check_options(softmax_scale, causal, window_size, deterministic, return_attn_probs,
                   dict(num_splits=num_splits, pack_gqa=pack_gqa, sm_margin=sm_margin),
                   _unsupported(qv, q_descale, k_descale, v_descale, attention_chunk, softcap,
                                dropout_p, alibi_slopes, block_table))
    varlen_args = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k)
    return _apply(q, k, v, varlen_args, softmax_scale, causal, window_size, deterministic,
                  return_attn_probs)


def _split_qkv(qkv, num_heads_q: Optional[int]):
    """Views q, k, v of a packed qkv: (b, s, 3, h, d), or (b, s, hq + 2 * hkv, d) with
    num_heads_q given (FlashAttention-3's GQA packing)."""
    if num_heads_q is None:
        _checks.check_packed("qkv", qkv, 3, "(batch, seqlen, 3, heads, head_dim)")
        return qkv.unbind(dim=2)
    _checks.check_is_tensor("qkv", qkv)
    if isinstance(num_heads_q, bool) or not isinstance(num_heads_q, int) or num_heads_q <= 0:
        raise TypeError(f"num_heads_q must be a positive int or None; got {num_heads_q!r}.")
    heads_kv2 = qkv.shape[2] - num_heads_q if qkv.dim() == 4 else -1
    if heads_kv2 <= 0 or heads_kv2 % 2 != 0:
        raise ValueError(f"with num_heads_q={num_heads_q}, qkv must be 4-D (batch, seqlen, "
                         f"num_heads_q + 2 * heads_kv, head_dim); got shape {tuple(qkv.shape)}.")
    return qkv.split([num_heads_q, heads_kv2 // 2, heads_kv2 // 2], dim=2)


def flash_attn_qkvpacked_func(qkv, softmax_scale=None, causal=False, q_descale=None,
                              k_descale=None, v_descale=None, window_size=(-1, -1),
                              attention_chunk=0, softcap=0.0, deterministic=False,
                              num_heads_q=None, sm_margin=0, return_attn_probs=False, *,
                              dropout_p=0.0, alibi_slopes=None):
    """Self-attention on a packed qkv (batch, seqlen, 3, heads, d), read through views.

    With num_heads_q, qkv is (batch, seqlen, num_heads_q + 2 * heads_kv, d) instead. The
    gradient flows back into qkv. Everything else is as in flash_attn_func.
    """
    q, k, v = _split_qkv(qkv, num_heads_q)
    return flash_attn_func(q, k, v, softmax_scale, causal, q_descale=q_descale,
                           k_descale=k_descale, v_descale=v_descale, window_size=window_size,
                           attention_chunk=attention_chunk, softcap=softcap,
                           deterministic=deterministic, sm_margin=sm_margin,
                           return_attn_probs=return_attn_probs, dropout_p=dropout_p,
                           alibi_slopes=alibi_slopes)


def flash_attn_kvpacked_func(q, kv, softmax_scale=None, causal=False, qv=None, q_descale=None,
                             k_descale=None, v_descale=None, window_size=(-1, -1),
                             attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                             deterministic=False, sm_margin=0, return_attn_probs=False, *,
                             dropout_p=0.0, alibi_slopes=None):
    """Attention with k and v packed as kv (batch, seqlen_k, 2, heads_kv, d), read through
    views; q (batch, seqlen_q, heads_q, d). Everything else is as in flash_attn_func."""
    _checks.check_packed("kv", kv, 2, "(batch, seqlen_k, 2, heads_kv, head_dim)")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, softmax_scale, causal, qv, q_descale, k_descale, v_descale,
                           window_size, attention_chunk, softcap, num_splits, pack_gqa,
                           deterministic, sm_margin, return_attn_probs, dropout_p=dropout_p,
                           alibi_slopes=alibi_slopes)
