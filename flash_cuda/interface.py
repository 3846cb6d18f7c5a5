"""The user API: FlashAttention-compatible attention functions over torch.ops.flash_cuda.

Layouts. Dense: q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv,
head_dim); out like q; softmax_lse float32 (batch, heads_q, seqlen_q). Varlen: sequences packed
along dimension 0, q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim),
cu_seqlens_* int32 (batch + 1,) prefix sums of the lengths; softmax_lse (heads_q, total_q).
Any strides are accepted: an input whose last dimension is not contiguous (or whose rows are
not 16-byte aligned) is copied once, as FlashAttention-3 does; others are read in place. out
(and each gradient) is laid out like the input it mirrors when that input's last dimension is
contiguous (torch.empty_like: the same strides for a dense input, the same order of dimensions
otherwise), else contiguous.

Semantics. softmax(softmax_scale * q k^T) v with softmax_scale defaulting to head_dim ** -0.5.
Masks are aligned bottom-right, as in FlashAttention: with Lq / Lk the query / key lengths of a
sequence, row i sees key j iff j >= i + Lk - Lq - window_left (when window_left >= 0) and
j <= i + Lk - Lq + window_right (when window_right >= 0); both bounds are inclusive and
causal=True means window_right = 0. A row that sees no key gets out = 0 and lse = -inf, and
no gradient. heads_q may be any multiple of heads_kv (GQA / MQA).

Arguments are converted as FlashAttention-3 converts them: max_seqlen_* may be any
integer-like (Python or numpy integer, SymInt, one-element integer tensor), window_size any
length-2 sequence or tensor of integer-likes, softmax_scale any float-like, flags Python or
numpy bools. CUDA tensors run the compiled kernels (float16 / bfloat16). CPU tensors run the
plain-PyTorch reference (float16 / bfloat16 / float32): correct, with float32 accumulation, but
not fast. num_splits, pack_gqa and sm_margin are performance hints that never change results;
they are validated and otherwise ignored. dropout_p and alibi_slopes are accepted for
FlashAttention-2 keyword compatibility, s_aux and learnable_sink (attention sinks) for
FlashAttention-3 / 4 and transformers callers, each only at its default. deterministic=True (or
torch.use_deterministic_algorithms(True)) asks for a reproducible backward: the CPU reference
always is one; a CUDA build whose backward is not
(build_info()["features"]["deterministic_backward"]) rejects it at the call when gradients
will be needed.

The autograd formula lives on the op (flash_cuda/_ops.py), so these functions only convert
arguments; the op's kernels check the tensors.
"""

import torch

# Importing _ops also registers the CPU, fake and autograd implementations of the ops.
from flash_cuda import _checks, _ops

__all__ = [
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "flash_attn_combine",
    "get_scheduler_metadata",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
]

_fwd = _ops.fwd


def _check_extras(qv, q_descale, k_descale, v_descale, attention_chunk, softcap, dropout_p,
                  alibi_slopes, s_aux, learnable_sink, block_table=None) -> None:
    """FlashAttention arguments flash_cuda does not implement: each is accepted at its default
    only, and anything else raises NotImplementedError naming it (never silently dropped)."""
    if (qv is None and q_descale is None and k_descale is None and v_descale is None
            and alibi_slopes is None and s_aux is None and learnable_sink is None
            and block_table is None and attention_chunk == 0 and softcap == 0.0
            and dropout_p == 0.0):
        return
    for name, value in (("qv", qv), ("q_descale", q_descale), ("k_descale", k_descale),
                        ("v_descale", v_descale), ("alibi_slopes", alibi_slopes),
                        ("s_aux", s_aux), ("learnable_sink", learnable_sink),
                        ("block_table", block_table)):
        _checks.check_not_supported(name, value)
    _checks.check_at_default("attention_chunk", attention_chunk, 0)
    _checks.check_at_default("softcap", softcap, 0.0)
    _checks.check_at_default("dropout_p", dropout_p, 0.0)


def _options(q, k, v, softmax_scale, causal, window_size, deterministic, return_attn_probs,
             num_splits, pack_gqa, sm_margin, varlen):
    """Converts the options shared by every entry point; returns (scale, causal, left, right,
    deterministic, return_attn_probs)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.check_is_tensor(name, t)
    if q.dim() == 0:  # shape[-1] below needs a dimension; the op checks ranks in full
        _checks.check_rank("q", q, varlen)
    scale = _checks.as_scale(softmax_scale, q.shape[-1])
    causal = _checks.as_flag("causal", causal)
    deterministic = _checks.as_flag("deterministic", deterministic)
    return_attn_probs = _checks.as_flag("return_attn_probs", return_attn_probs)
    if type(window_size) is tuple and window_size == (-1, -1):
        left, right = -1, -1
    else:
        left, right = _checks.as_window(window_size)
    if causal:
        right = 0
    if not (num_splits == 1 and pack_gqa is None and sm_margin == 0):
        _checks.check_hints(num_splits, pack_gqa, sm_margin)
    _checks.check_deterministic_backward(deterministic, q, k, v,
                                         _ops.CUDA_DETERMINISTIC_BACKWARD)
    return scale, causal, left, right, deterministic, return_attn_probs


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False, *, dropout_p=0.0, alibi_slopes=None, s_aux=None,
                    learnable_sink=None):
    """Dense attention: q (batch, seqlen_q, heads_q, d), k/v (batch, seqlen_k, heads_kv, d).

    Returns out like q, or (out, softmax_lse) with return_attn_probs=True, softmax_lse being
    float32 (batch, heads_q, seqlen_q). Masks are bottom-right aligned, windows inclusive,
    causal means window_size[1] = 0; rows that see no key give out 0 and lse -inf. On CPU the
    plain-PyTorch reference runs (correct, not fast). qv, the descales, attention_chunk,
    softcap, dropout_p, alibi_slopes, s_aux and learnable_sink are accepted only at their
    defaults; num_splits, pack_gqa and sm_margin are hints with no effect on results.
    """
    scale, causal, left, right, deterministic, return_lse = _options(
        q, k, v, softmax_scale, causal, window_size, deterministic, return_attn_probs,
        num_splits, pack_gqa, sm_margin, varlen=False)
    _check_extras(qv, q_descale, k_descale, v_descale, attention_chunk, softcap, dropout_p,
                  alibi_slopes, s_aux, learnable_sink)
    if q.dim() != 4:  # the op would name the dense layout too; this keeps shape[1] safe
        _checks.check_rank("q", q, varlen=False)
    if k.dim() != 4:
        _checks.check_rank("k", k, varlen=False)
    out, lse = _fwd(q, k, v, None, None, None, None, q.shape[1], k.shape[1], scale, causal,
                    left, right, deterministic)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False, *, dropout_p=0.0, alibi_slopes=None,
                           page_table=None, block_table=None, s_aux=None, learnable_sink=None,
                           out=None):
    """Attention over packed variable-length sequences.

    q (total_q, heads_q, d), k/v (total_k, heads_kv, d); sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q (int32, batch + 1 entries, starting at 0) and
    likewise for k/v. max_seqlen_q / max_seqlen_k (integer-likes) must be at least the longest
    sequence (checked on CPU; on CUDA checking would need a device sync). seqused_q / seqused_k
    (int32, (batch,)) optionally keep only the first seqused[b] rows of each sequence; the
    others get out 0, lse -inf and zero gradients. Returns out like q, or (out, softmax_lse)
    with softmax_lse float32 (heads_q, total_q). Masks, defaults and unsupported arguments are
    as in flash_attn_func; on CPU the reference runs (correct, not fast).

    The inference call shape (forward only): cu_seqlens_k=None with seqused_k (int32, (batch,))
    over a cache, k / v (batch, seqlen_cache, heads_kv, d), or paged (num_pages, page_size,
    heads_kv, d) with page_table (batch, pages per sequence) int32 (block_table is another name
    for it); sequence b sees the first seqused_k[b] keys of its cache row. It is
    flash_attn_with_kvcache without new keys (max_seqlen_k is then not needed), on CUDA and
    CPU tensors alike. out (keyword only, q's shape and dtype) is written in place and
    returned; it is accepted in the inference call shape only.
    """
    if block_table is not None:
        if page_table is not None and page_table is not block_table:
            raise ValueError("page_table and block_table are two names for one argument: pass "
                             "one of them.")
        page_table = block_table
    if cu_seqlens_k is None or page_table is not None:
        return _varlen_over_cache(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q,
                                  seqused_k, page_table, softmax_scale, causal, window_size,
                                  qv, q_descale, k_descale, v_descale, attention_chunk, softcap,
                                  num_splits, pack_gqa, sm_margin, return_attn_probs, dropout_p,
                                  alibi_slopes, s_aux, learnable_sink, out)
    if out is not None:
        raise NotImplementedError("flash_attn_varlen_func: out= is supported in the inference "
                                  "call shape only (cu_seqlens_k=None with seqused_k over a "
                                  "cache); pass out=None.")
    scale, causal, left, right, deterministic, return_lse = _options(
        q, k, v, softmax_scale, causal, window_size, deterministic, return_attn_probs,
        num_splits, pack_gqa, sm_margin, varlen=True)
    _check_extras(qv, q_descale, k_descale, v_descale, attention_chunk, softcap, dropout_p,
                  alibi_slopes, s_aux, learnable_sink)
    _checks.check_is_tensor("cu_seqlens_q", cu_seqlens_q)
    _checks.check_is_tensor("cu_seqlens_k", cu_seqlens_k)
    _checks.check_optional_tensor("seqused_q", seqused_q)
    _checks.check_optional_tensor("seqused_k", seqused_k)
    max_seqlen_q = _checks.as_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _checks.as_int("max_seqlen_k", max_seqlen_k)
    out, lse = _fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                    max_seqlen_k, scale, causal, left, right, deterministic)
    return (out, lse) if return_lse else out


def _varlen_over_cache(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_q,
                       seqused_k, page_table, softmax_scale, causal, window_size, qv, q_descale,
                       k_descale, v_descale, attention_chunk, softcap, num_splits, pack_gqa,
                       sm_margin, return_attn_probs, dropout_p, alibi_slopes, s_aux,
                       learnable_sink, out):
    """flash_attn_varlen_func's inference call shape, through the KV-cache op."""
    _check_extras(qv, q_descale, k_descale, v_descale, attention_chunk, softcap, dropout_p,
                  alibi_slopes, s_aux, learnable_sink)
    if cu_seqlens_k is not None:
        raise ValueError("page_table (block_table) addresses keys through pages of a cache: "
                         "pass cu_seqlens_k=None and each sequence's key count in seqused_k.")
    if seqused_k is None:
        raise ValueError("with cu_seqlens_k=None, k and v are a cache and seqused_k (int32, "
                         "(batch,)) gives each sequence's key count: pass it.")
    if seqused_q is not None:
        raise NotImplementedError("flash_attn_varlen_func: seqused_q is not supported with "
                                  "cu_seqlens_k=None (the inference call shape); pass None.")
    for name, t in (("q", q), ("k", k_cache), ("v", v_cache)):
        _checks.check_is_tensor(name, t)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise NotImplementedError("flash_attn_varlen_func over a cache (cu_seqlens_k=None) is "
                                  "forward only: call it under torch.no_grad() or with inputs "
                                  "that do not require grad.")
    _checks.check_is_tensor("cu_seqlens_q", cu_seqlens_q)
    return flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqused_k, page_table=page_table,
        cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q, softmax_scale=softmax_scale,
        causal=causal, window_size=window_size, num_splits=num_splits, pack_gqa=pack_gqa,
        sm_margin=sm_margin, return_softmax_lse=return_attn_probs, out=out)


def _split_qkv(qkv, num_heads_q):
    """Views q, k, v of a packed qkv: (b, s, 3, h, d), or (b, s, hq + 2 * hkv, d) with
    num_heads_q given (FlashAttention-3's GQA packing)."""
    if num_heads_q is None:
        _checks.check_packed("qkv", qkv, 3, "(batch, seqlen, 3, heads, head_dim)")
        return qkv.unbind(dim=2)
    _checks.check_is_tensor("qkv", qkv)
    num_heads_q = _checks.as_int("num_heads_q", num_heads_q)
    if num_heads_q <= 0:
        raise ValueError(f"num_heads_q must be a positive int or None; got {num_heads_q!r}.")
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
    """Self-attention on a packed qkv (batch, seqlen, 3, heads, d), read through views
    (FlashAttention-3's signature).

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


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """Attention with k and v packed as kv (batch, seqlen_k, 2, heads_kv, d), read through
    views; q (batch, seqlen_q, heads_q, d). FlashAttention-2's signature (FlashAttention-3 has
    no kvpacked function): dropout_p comes third, and return_attn_probs=True returns
    (out, softmax_lse, None), the None standing for FlashAttention-2's S_dmask, which exists
    only with dropout. Everything else is as in flash_attn_func.
    """
    _checks.check_packed("kv", kv, 2, "(batch, seqlen_k, 2, heads_kv, head_dim)")
    k, v = kv.unbind(dim=2)
    result = flash_attn_func(q, k, v, softmax_scale, causal, window_size=window_size,
                             softcap=softcap, deterministic=deterministic,
                             return_attn_probs=return_attn_probs, dropout_p=dropout_p,
                             alibi_slopes=alibi_slopes)
    return result + (None,) if isinstance(result, tuple) else result


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False, *, out=None):
    """Attention over a KV cache, forward only (FlashAttention-3's signature and semantics:
    flash_cuda/reference_kvcache.py states them in full).

    k_cache / v_cache: dense (batch_cache, seqlen_cache, heads_kv, d), or paged (num_pages,
    page_size, heads_kv, d) with page_table (batch, pages per sequence) int32, any page size.
    k / v (optional): new keys and values, written into the cache in place at cache_seqlens
    (an int or an int32 (batch,) tensor of the rows already there) and then attended to, after
    rotary embedding of them and of q when rotary_cos / rotary_sin are given ((positions,
    rotary_dim / 2); float32 or q's dtype with a unit last stride are read in place on CUDA,
    other tables are converted to float32 on every call). cache_batch_idx
    picks cache rows, cache_leftpad skips rows at the start of each, cu_seqlens_q /
    cu_seqlens_k_new pack q and the new keys. Returns out like q, or (out, softmax_lse) with
    return_softmax_lse=True; out (keyword only, q's shape, dtype and device, contiguous last
    dimension) is written in place and returned when given.

    CPU tensors run the plain-PyTorch reference; CUDA tensors the build's KV-cache kernels (the
    caches must have 16-byte aligned rows: they are written in place). num_splits splits the
    keys across blocks (0: a heuristic from the batch, heads, cache capacity and SM count; the
    results do not depend on it beyond rounding). qv, the descales, attention_chunk and softcap
    are accepted only at their defaults; pack_gqa and sm_margin are hints.
    scheduler_metadata (from get_scheduler_metadata) fixes the split count.
    """
    _check_extras(qv, q_descale, k_descale, v_descale, attention_chunk, softcap, 0.0, None,
                  None, None)
    _checks.check_hints(num_splits, pack_gqa, sm_margin)
    if scheduler_metadata is not None:
        num_splits = _splits_of_metadata(scheduler_metadata, num_splits)
    _checks.check_is_tensor("q", q)
    scale = _checks.as_scale(softmax_scale, q.shape[-1])
    causal = _checks.as_flag("causal", causal)
    left, right = _checks.as_window(window_size)
    interleaved = _checks.as_flag("rotary_interleaved", rotary_interleaved)
    return_lse = _checks.as_flag("return_softmax_lse", return_softmax_lse)
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        batch = q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
        cache_seqlens = torch.full((batch,), _checks.as_int("cache_seqlens", cache_seqlens),
                                   dtype=torch.int32, device=q.device)
    if max_seqlen_q is not None:
        max_seqlen_q = _checks.as_int("max_seqlen_q", max_seqlen_q)
    _checks.check_optional_tensor("out", out)
    if out is None:
        out = torch.empty_like(q) if q.stride(-1) == 1 else torch.empty(
            q.shape, dtype=q.dtype, device=q.device)
    lse = _ops.fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                           cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q,
                           cu_seqlens_k_new, max_seqlen_q, rotary_seqlens, scale, causal, left,
                           right, interleaved, int(num_splits), out)
    return (out, lse) if return_lse else out


def _splits_of_metadata(metadata, num_splits):
    """The split count a get_scheduler_metadata tensor fixes: its length (num_splits, which
    get_scheduler_metadata has already taken into account, is then not consulted)."""
    _checks.check_is_tensor("scheduler_metadata", metadata)
    if metadata.dim() != 1 or metadata.dtype != torch.int32 or \
            not 1 <= metadata.shape[0] <= _checks.KVCACHE_MAX_SPLITS:
        raise ValueError("scheduler_metadata must be what get_scheduler_metadata returns (1-D "
                         f"int32, 1 to {_checks.KVCACHE_MAX_SPLITS} long); got {metadata.dtype} of "
                         f"shape {tuple(metadata.shape)}.")
    return metadata.shape[0]  # it wins over num_splits, which made it


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                           headdim, cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None,
                           cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           page_size=None, max_seqlen_k_new=0, causal=False,
                           window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    """The schedule of flash_attn_with_kvcache for problems of these sizes (FlashAttention-3's
    signature), to pass back as its scheduler_metadata, e.g. to capture a decode step in a CUDA
    graph and replay it with new cache_seqlens.

    flash_cuda's schedule is its split count, which depends on the sizes only (batch, heads,
    query rows, max_seqlen_k as the cache's capacity, the SM count), never on cache_seqlens'
    values, so every call is capture-safe with or without it; the metadata fixes the count so
    that a later call with another cache size keeps it. Returns an int32 tensor on
    cache_seqlens' device whose length is that count (its values are unused).
    """
    _checks.check_is_tensor("cache_seqlens", cache_seqlens)
    ints = {name: _checks.as_int(name, value) for name, value in (
        ("batch_size", batch_size), ("max_seqlen_q", max_seqlen_q),
        ("max_seqlen_k", max_seqlen_k), ("num_heads_q", num_heads_q),
        ("num_heads_kv", num_heads_kv), ("headdim", headdim))}
    if headdim_v is not None and _checks.as_int("headdim_v", headdim_v) != ints["headdim"]:
        raise NotImplementedError("get_scheduler_metadata: headdim_v must equal headdim (no "
                                  "separate value head dim in flash_cuda).")
    _checks.check_at_default("attention_chunk", attention_chunk, 0)
    _checks.check_at_default("has_softcap", has_softcap, False)
    _checks.check_hints(num_splits, pack_gqa, sm_margin)
    if ints["num_heads_kv"] < 1 or ints["num_heads_q"] % ints["num_heads_kv"] != 0:
        raise ValueError(f"num_heads_q ({ints['num_heads_q']}) must be a multiple of "
                         f"num_heads_kv ({ints['num_heads_kv']}) >= 1.")
    if not (_checks.MIN_HEAD_DIM <= ints["headdim"] <= _checks.MAX_HEAD_DIM and
            ints["headdim"] % _checks.HEAD_DIM_MULTIPLE == 0):
        raise ValueError(f"headdim must be a multiple of {_checks.HEAD_DIM_MULTIPLE} between "
                         f"{_checks.MIN_HEAD_DIM} and {_checks.MAX_HEAD_DIM}; got "
                         f"{ints['headdim']}.")
    if qkv_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"qkv_dtype must be torch.float16 or torch.bfloat16; got {qkv_dtype!r}.")
    if page_size is not None and _checks.as_int("page_size", page_size) < 1:
        raise ValueError(f"page_size must be at least 1 (or None: no pages); got {page_size}.")
    left, _ = _checks.as_window(window_size)
    splits = _num_splits(
        cache_seqlens.device, ints["batch_size"], ints["max_seqlen_q"], cu_seqlens_q is not None,
        ints["num_heads_q"], ints["num_heads_kv"], ints["headdim"], ints["max_seqlen_k"],
        qkv_dtype, left, int(num_splits),
        0 if page_size is None else _checks.as_int("page_size", page_size),
        cache_leftpad is not None)
    return torch.empty(splits, dtype=torch.int32, device=cache_seqlens.device)


def _num_splits(device, *sizes):
    """The split count of get_scheduler_metadata, a function of the sizes and the device only:
    traced (torch.compile), it runs once at trace time and the graph holds the count."""
    return torch.ops.flash_cuda._kvcache_num_splits(
        torch.empty(0, dtype=torch.int32, device=device), *sizes)


# What torch.compiler.assume_constant_result(_num_splits) does, without importing the compiler
# (0.7 s) when flash_cuda is imported.  tests/test_kvcache.py compiles a step that calls
# get_scheduler_metadata: a torch that marks such functions otherwise fails there.
_num_splits._dynamo_marked_constant = True


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None):
    """Merges the results of attention over splits of the keys (FlashAttention-3's signature).

    out_partial (num_splits, batch, seqlen, heads, d), or packed (num_splits, total_q, heads, d),
    float32: each split's attention output, normalised over its own keys. lse_partial: its
    shape without d, float32: each split's log-sum-exp (-inf where a row saw none of the split's
    keys; such a split then weighs nothing, whatever out_partial holds there). Returns
    (out, softmax_lse): out (batch, seqlen, heads, d) in out_dtype (default float32), written
    into `out` when given, and the merged log-sum-exp (batch, seqlen, heads) float32. A row no
    split saw gets out 0 and lse -inf; one split gives out_partial[0] exactly.

    On CUDA, fp16 / bf16 outputs over 16-byte aligned partials of at most 256 splits and head
    dim 256 go through flash_cuda's combine kernel; other cases, and the CPU, run PyTorch
    operations.
    """
    _checks.check_is_tensor("out_partial", out_partial)
    _checks.check_optional_tensor("out", out)
    if out_dtype is not None and out_dtype not in _checks.COMBINE_OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.float32, torch.float16 or torch.bfloat16 "
                         f"(or None for float32); got {out_dtype!r}.")
    if out is None:
        out = out_partial.new_empty(out_partial.shape[1:], dtype=out_dtype or torch.float32)
    elif out_dtype is not None and out.dtype != out_dtype:
        raise ValueError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}: pass one "
                         f"or make them agree.")
    lse = _ops.combine(out_partial, lse_partial, out)
    return out, lse
