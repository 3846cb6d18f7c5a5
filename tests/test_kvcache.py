"""flash_attn_with_kvcache and torch.ops.flash_cuda.fwd_kvcache: the API over the op, the op's
rules and not-yet-implemented arguments, its declared mutation of the caches (opcheck), a decode
step under torch.compile(fullgraph=True), and the clear error on CUDA from a build without
KV-cache kernels (FLASH_CUDA_DISABLE_KVCACHE=1); tests/test_kvcache_cuda.py runs the kernels."""

import pytest
import torch

import flash_cuda
from flash_cuda import flash_attn_with_kvcache
from flash_cuda.reference_kvcache import kvcache_forward_reference

B, HQ, HK, D, CAP = 2, 4, 2, 64, 48


def case(seqlen_q=1, n_new=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, seqlen_q, HQ, D, generator=g, dtype=dtype)
    k_cache, v_cache = (torch.randn(B, CAP, HK, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, n_new, HK, D, generator=g, dtype=dtype) for _ in range(2))
    cos = torch.randn(64, 16, generator=g)
    return q, k_cache, v_cache, k, v, cos, torch.randn(64, 16, generator=g)


@pytest.mark.parametrize("paged", [False, True])
def test_api_appends_rotates_and_attends(paged):
    q, k_cache, v_cache, k, v, cos, sin = case(seqlen_q=3, n_new=3)
    lengths = torch.tensor([4, 30], dtype=torch.int32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = kvcache_forward_reference(q, ref_k, ref_v, k, v, cos, sin, cache_seqlens=lengths,
                                     causal=True)
    kwargs = {}
    if paged:  # pages of 16 rows in reverse order
        (k_cache, table), (v_cache, _) = _paged(k_cache, 16), _paged(v_cache, 16)
        kwargs = {"page_table": table}
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                       rotary_sin=sin, cache_seqlens=lengths, causal=True,
                                       return_softmax_lse=True, **kwargs)
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, want[1], atol=0, rtol=0)
    row = (table[1, 30 // 16], 30 % 16) if paged else (1, 30)
    torch.testing.assert_close(k_cache[row], ref_k[1, 30])  # the new key landed in the cache


def test_int_cache_seqlens_and_defaults():
    q, k_cache, v_cache, k, v, _, _ = case()
    out = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=7)
    want = kvcache_forward_reference(q, k_cache, v_cache, k, v, cache_seqlens=7,
                                     softmax_scale=D ** -0.5)
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)


def test_out_is_written_in_place():
    q, k_cache, v_cache, k, v, _, _ = case(seqlen_q=2, n_new=2)
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=5)
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5, out=out,
                                       return_softmax_lse=True)
    assert got is out and lse.shape == (B, HQ, 2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    for bad, match in ((torch.empty(B, 2, HQ, D + 8), "out must have q's shape"),
                       (torch.empty(B, 2, HQ, 2 * D)[..., ::2], "contiguous last dimension")):
        with pytest.raises(ValueError, match=match):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5, out=bad)


@pytest.mark.parametrize("name, value", [("qv", "tensor"), ("q_descale", "tensor"),
                                         ("softcap", 1.0), ("attention_chunk", 8)])
def test_not_implemented_arguments_name_themselves(name, value):
    q, k_cache, v_cache, _, _, _, _ = case()
    value = torch.zeros(1) if value == "tensor" else value
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, **{name: value})


@pytest.mark.parametrize("change, match", [
    (dict(k="alone"), "k and v go together"),
    (dict(page_table=True, cache_batch_idx=True), "pass one or the other"),
    (dict(cache_seqlens=torch.tensor([1, 2])), "cache_seqlens must have dtype int32"),
    (dict(rotary_dim=8), "rotary dim"),
    (dict(cache_dtype=torch.float16), "k_cache must have q's dtype"),
    (dict(cache_seqlens=None), "cache_seqlens .* is required"),
    (dict(cache_rows=1), "pass cache_batch_idx to pick rows"),
    (dict(cache_rows=0), "k_cache has no rows"),
])
def test_op_rules_name_the_argument(change, match):
    q, k_cache, v_cache, k, v, cos, sin = case()
    args = dict(k=k, v=v, cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))
    if change.get("k") == "alone":
        args.pop("v")
    if change.get("page_table"):
        args.update(page_table=torch.zeros(B, 3, dtype=torch.int32),
                    cache_batch_idx=torch.zeros(B, dtype=torch.int32))
    if "rotary_dim" in change:
        args.update(rotary_cos=cos[:, :change["rotary_dim"] // 2],
                    rotary_sin=sin[:, :change["rotary_dim"] // 2])
    if "cache_dtype" in change:
        k_cache = k_cache.to(change["cache_dtype"])
    if "cache_rows" in change:
        k_cache, v_cache = k_cache[:change["cache_rows"]], v_cache[:change["cache_rows"]]
    if "cache_seqlens" in change:
        args["cache_seqlens"] = change["cache_seqlens"]
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, **args)


def _op_args(q, k_cache, v_cache, k, v, cos, sin):
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    return (q, k_cache, v_cache, k, v, cos, sin, lengths, None, None, None, None, None, None,
            None, D ** -0.5, True, -1, -1, True, 0, torch.empty_like(q))


def test_opcheck_declares_the_cache_mutation():
    """opcheck's schema test fails when an op writes a tensor its schema does not mark (a!)."""
    q, k_cache, v_cache, k, v, cos, sin = case(seqlen_q=2, n_new=2)
    torch.library.opcheck(torch.ops.flash_cuda.fwd_kvcache.default,
                          _op_args(q, k_cache, v_cache, k, v, cos, sin))


def test_decode_step_compiles_fullgraph():
    q, k_cache, v_cache, k, v, _, _ = case()
    lengths = torch.tensor([3, 9], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                       causal=True)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = step(q, eager_k, eager_v, k, v)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, eager_k, atol=0, rtol=0)  # the compiled step wrote it


def test_scheduler_metadata_inside_a_compiled_step():
    """get_scheduler_metadata traced with the step: its count is a constant of the graph."""
    from flash_cuda import get_scheduler_metadata
    q, k_cache, v_cache, k, v, _, _ = case()
    lengths = torch.tensor([3, 9], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v):
        meta = get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, qkv_dtype=torch.float16,
                                      num_splits=3)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                      causal=True, scheduler_metadata=meta)
        return out, meta

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want, want_meta = step(q, eager_k, eager_v, k, v)
    got, got_meta = torch.compile(step, fullgraph=True, backend="aot_eager")(
        q, k_cache, v_cache, k, v)
    assert got_meta.shape == want_meta.shape == (3,)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, eager_k, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_without_kvcache_kernels_says_so():
    if flash_cuda.build_info()["head_dims"]["fwd_kvcache"]:
        pytest.skip("this build holds KV-cache kernels (tests/test_kvcache_cuda.py runs them)")
    q, k_cache, v_cache, k, v, _, _ = (t.cuda() for t in case(dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="without"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)


def test_exported_from_the_package():
    assert "flash_attn_with_kvcache" in flash_cuda.__all__


def _paged(cache, page):
    """cache (B, CAP, heads, d) as pages of `page` rows, handed out in reverse order."""
    pages = CAP // page
    table = torch.arange(B * pages - 1, -1, -1, dtype=torch.int32).view(B, pages)
    paged = torch.empty(B * pages, page, *cache.shape[2:], dtype=cache.dtype)
    for b in range(B):
        for p in range(pages):
            paged[table[b, p]] = cache[b, p * page:(p + 1) * page]
    return paged, table


@pytest.mark.parametrize("layout", ["dense", "page_table", "block_table"])
def test_varlen_inference_call_shape(layout):
    """flash_attn_varlen_func(cu_seqlens_k=None, seqused_k=...) over a cache: each sequence
    attends to the first seqused_k[b] keys of its cache row, bottom-right causal."""
    from flash_cuda import flash_attn_varlen_func
    from flash_cuda.reference import attention_forward_reference
    q, k_cache, v_cache, _, _, _, _ = case(seqlen_q=3)
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)  # 3 query rows, then 1
    q = q.flatten(0, 1)[:4]
    used = torch.tensor([20, 7], dtype=torch.int32)
    want_out, want_lse = [], []
    for b in range(B):
        o, lse = attention_forward_reference(
            q[cu_q[b]:cu_q[b + 1]][None], k_cache[b:b + 1, :used[b]],
            v_cache[b:b + 1, :used[b]], softmax_scale=D ** -0.5, causal=True)
        want_out.append(o[0])
        want_lse.append(lse[0])
    kwargs = {}
    if layout != "dense":
        (k_cache, table), (v_cache, _) = _paged(k_cache, 16), _paged(v_cache, 16)
        kwargs[layout] = table
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 3, None, seqused_k=used,
                                      causal=True, return_attn_probs=True, out=out, **kwargs)
    assert got is out
    torch.testing.assert_close(out, torch.cat(want_out), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, torch.cat(want_lse, dim=1), atol=1e-6, rtol=1e-5)


def test_varlen_inference_call_shape_rules():
    from flash_cuda import flash_attn_varlen_func
    q, k_cache, v_cache, _, _, _, _ = case()
    q = q.flatten(0, 1)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    used = torch.tensor([4, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqused_k .* gives each sequence's key count"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None)
    with pytest.raises(NotImplementedError, match="seqused_q"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None, seqused_q=used,
                               seqused_k=used)
    with pytest.raises(NotImplementedError, match="forward only"):
        flash_attn_varlen_func(q.requires_grad_(), k_cache, v_cache, cu_q, None, 1, None,
                               seqused_k=used)
    with pytest.raises(ValueError, match="two names for one argument"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None, seqused_k=used,
                               page_table=torch.zeros(B, 3, dtype=torch.int32),
                               block_table=torch.zeros(B, 3, dtype=torch.int32))


def test_scheduler_metadata_fixes_the_split_count():
    from flash_cuda import get_scheduler_metadata
    q, k_cache, v_cache, k, v, _, _ = case()
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    meta = get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, qkv_dtype=torch.float16,
                                  num_splits=3)
    assert meta.dtype == torch.int32 and meta.shape == (3,)
    assert get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths).shape == (1,)  # CPU: no split
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                   cache_seqlens=lengths)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                  scheduler_metadata=meta)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, num_splits=500).shape == (256,)
    with pytest.raises(ValueError, match="must be what get_scheduler_metadata returns"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                scheduler_metadata=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="headdim_v"):
        get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, headdim_v=D // 2)
    with pytest.raises(ValueError, match="page_size must be at least 1"):
        get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, page_size=0)


@pytest.mark.parametrize("paged", [False, True])
def test_head_major_caches_are_read_and_written_in_place(paged):
    """Caches stored heads before rows ("HND": (B, heads, rows, d) or (pages, heads, page, d)
    memory, passed as the transposed view) give the results of row-major ones, bit for bit, and
    the new keys land in that memory."""
    q, k_cache, v_cache, k, v, cos, sin = case(seqlen_q=2, n_new=2)
    lengths = torch.tensor([5, 33], dtype=torch.int32)
    kwargs = {}
    if paged:
        (k_cache, table), (v_cache, _) = _paged(k_cache, 16), _paged(v_cache, 16)
        kwargs = {"page_table": table}
    args = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=True,
                return_softmax_lse=True, **kwargs)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = flash_attn_with_kvcache(q, want_k, want_v, k, v, **args)
    hnd_k, hnd_v = (c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    got = flash_attn_with_kvcache(q, hnd_k.transpose(1, 2), hnd_v.transpose(1, 2), k, v, **args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    torch.testing.assert_close(hnd_k.transpose(1, 2), want_k, atol=0, rtol=0)
    torch.testing.assert_close(hnd_v.transpose(1, 2), want_v, atol=0, rtol=0)
    assert not torch.equal(want_k, k_cache)  # the append wrote something to compare
