"""flash_cuda/reference_kvcache.py, the KV-cache oracle, against attention written out by hand:
the append in place, rotary (both layouts, both position rules), dense and paged caches of any
page size, cache_batch_idx, cache_leftpad, packed queries and new keys, and its input errors."""

import math

import pytest
import torch

from flash_cuda.reference import attention_naive
from flash_cuda.reference_kvcache import apply_rotary, kvcache_forward_reference

torch.manual_seed(0)
B, HQ, HK, D, CAP = 3, 4, 2, 32, 40


def rotary_tables(rotary_dim, positions=64):
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.outer(torch.arange(positions).float(), inv)
    return angles.cos(), angles.sin()


def expected(q, cache_k, cache_v, lengths, k_new, v_new, cos, sin, causal, window, leftpad,
             rotary_start=None, interleaved=True):
    """Per sequence: rotate, append, attend (float64, attention_naive) -> (out, lse, caches)."""
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    outs, lses = [], []
    for b in range(q.shape[0]):
        n, length = k_new.shape[1], lengths[b]
        p0 = length if rotary_start is None else rotary_start[b]
        kb, qb = k_new[b], q[b]
        if cos is not None:
            kb = apply_rotary(kb, cos, sin, torch.arange(p0, p0 + n), interleaved)
            local = causal or window != (-1, -1)
            pos = torch.arange(p0, p0 + qb.shape[0]) if local else torch.full((qb.shape[0],), p0)
            qb = apply_rotary(qb, cos, sin, pos, interleaved)
        cache_k[b, length:length + n], cache_v[b, length:length + n] = kb, v_new[b]
        keys = slice(leftpad[b], length + n)
        o, l = attention_naive(qb[None], cache_k[b, keys][None], cache_v[b, keys][None],
                               softmax_scale=D ** -0.5, causal=causal, window_left=window[0],
                               window_right=window[1])
        outs.append(o[0].float())
        lses.append(l[0].float())
    return torch.stack(outs), torch.stack(lses), cache_k, cache_v


def make_case(seqlen_q=3, n_new=2):
    q = torch.randn(B, seqlen_q, HQ, D)
    cache_k, cache_v = torch.randn(B, CAP, HK, D), torch.randn(B, CAP, HK, D)
    k_new, v_new = torch.randn(B, n_new, HK, D), torch.randn(B, n_new, HK, D)
    return q, cache_k, cache_v, k_new, v_new


def test_apply_rotary_is_a_rotation():
    """Norms of each rotated pair are kept; position 0 is the identity; the two layouts pair
    different dimensions."""
    cos, sin = rotary_tables(16)
    x = torch.randn(5, 2, D)
    for interleaved in (True, False):
        y = apply_rotary(x, cos, sin, torch.arange(5), interleaved)
        torch.testing.assert_close(y[0], x[0])
        torch.testing.assert_close(y[..., 16:], x[..., 16:])
        torch.testing.assert_close(y[..., :16].norm(dim=-1), x[..., :16].norm(dim=-1))
    a = apply_rotary(x, cos, sin, torch.arange(5), True)
    b = apply_rotary(x, cos, sin, torch.arange(5), False)
    assert not torch.allclose(a[1:], b[1:])


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (5, 1))])
@pytest.mark.parametrize("rotary,interleaved", [(False, True), (True, True), (True, False)])
def test_dense_cache_append_and_attend(causal, window, rotary, interleaved):
    q, cache_k, cache_v, k_new, v_new = make_case()
    lengths = [0, 7, 30]
    cos, sin = rotary_tables(16) if rotary else (None, None)
    want = expected(q, cache_k, cache_v, lengths, k_new, v_new, cos, sin, causal, window,
                    [0] * B, interleaved=interleaved)
    out, lse = kvcache_forward_reference(
        q, cache_k, cache_v, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(lengths, dtype=torch.int32), causal=causal,
        window_size=window, rotary_interleaved=interleaved)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_k, want[2])  # written in place, the rest untouched
    torch.testing.assert_close(cache_v, want[3])


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_cache_equals_dense(page_size):
    """Pages in a shuffled order give the dense answer, and the new rows land in the pages."""
    q, cache_k, cache_v, k_new, v_new = make_case()
    lengths = torch.tensor([5, 0, 33], dtype=torch.int32)
    cos, sin = rotary_tables(16)
    dense = kvcache_forward_reference(q, cache_k.clone(), cache_v.clone(), k_new, v_new, cos,
                                      sin, cache_seqlens=lengths, causal=True)
    pages_per_seq = math.ceil(CAP / page_size)
    order = torch.randperm(B * pages_per_seq)
    page_table = order.view(B, pages_per_seq).to(torch.int32)
    paged_k = torch.zeros(B * pages_per_seq, page_size, HK, D)
    paged_v = torch.zeros_like(paged_k)
    for b in range(B):
        for r in range(CAP):
            page, off = page_table[b, r // page_size], r % page_size
            paged_k[page, off], paged_v[page, off] = cache_k[b, r], cache_v[b, r]
    out, lse = kvcache_forward_reference(q, paged_k, paged_v, k_new, v_new, cos, sin,
                                         cache_seqlens=lengths, page_table=page_table,
                                         causal=True)
    torch.testing.assert_close(out, dense[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, dense[1], atol=0, rtol=0)
    new_rows = apply_rotary(k_new[2], cos, sin, torch.arange(33, 35), True)
    for i, r in enumerate(range(33, 35)):
        torch.testing.assert_close(paged_k[page_table[2, r // page_size], r % page_size],
                                   new_rows[i])


def test_cache_batch_idx_and_leftpad():
    q, cache_k, cache_v, k_new, v_new = make_case()
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    lengths, leftpad = [9, 4, 20], [3, 0, 19]
    want = expected(q, cache_k[idx.long()], cache_v[idx.long()], lengths, k_new, v_new, None,
                    None, True, (-1, -1), leftpad)
    out, lse = kvcache_forward_reference(
        q, cache_k, cache_v, k_new, v_new, cache_seqlens=torch.tensor(lengths),
        cache_batch_idx=idx, cache_leftpad=torch.tensor(leftpad), causal=True)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache_k[idx.long()], want[2])


def test_rotary_seqlens_sets_the_positions():
    q, cache_k, cache_v, k_new, v_new = make_case()
    cos, sin = rotary_tables(32)
    start = [11, 0, 2]
    want = expected(q, cache_k, cache_v, [4, 4, 4], k_new, v_new, cos, sin, False, (-1, -1),
                    [0] * B, rotary_start=start)
    out, _ = kvcache_forward_reference(q, cache_k, cache_v, k_new, v_new, cos, sin,
                                       cache_seqlens=4, rotary_seqlens=torch.tensor(start))
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)


def test_packed_queries_and_new_keys():
    """cu_seqlens_q / cu_seqlens_k_new (chunked prefill): each sequence as its own dense call."""
    lens_q, lens_new, lengths = [2, 0, 5], [1, 3, 5], [6, 0, 12]
    cu_q = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 4, 9], dtype=torch.int32)
    q = torch.randn(7, HQ, D)
    k_new, v_new = torch.randn(9, HK, D), torch.randn(9, HK, D)
    cache_k, cache_v = torch.randn(B, CAP, HK, D), torch.randn(B, CAP, HK, D)
    ref_k, ref_v = cache_k.clone(), cache_v.clone()
    out, lse = kvcache_forward_reference(q, cache_k, cache_v, k_new, v_new,
                                         cache_seqlens=torch.tensor(lengths),
                                         cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_k, causal=True)
    assert lse.shape == (HQ, 7)
    for b in range(B):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o_b, l_b = kvcache_forward_reference(
            q[qs][None], ref_k[b:b + 1], ref_v[b:b + 1], k_new[ks][None], v_new[ks][None],
            cache_seqlens=lengths[b], causal=True)
        torch.testing.assert_close(out[qs], o_b[0], atol=0, rtol=0)
        torch.testing.assert_close(lse[:, qs], l_b[0], atol=0, rtol=0)
    torch.testing.assert_close(cache_k, ref_k.index_put_(
        (torch.tensor([0, 1, 1, 1, 2, 2, 2, 2, 2]), torch.tensor([6, 0, 1, 2, 12, 13, 14, 15, 16])),
        k_new))


def test_no_new_keys_reads_the_cache_as_it_is():
    q, cache_k, cache_v, _, _ = make_case()
    before = cache_k.clone()
    out, _ = kvcache_forward_reference(q, cache_k, cache_v, cache_seqlens=torch.tensor([1, 2, 3]))
    want, _ = attention_naive(q[1:2], cache_k[1:2, :2], cache_v[1:2, :2], softmax_scale=D ** -0.5)
    torch.testing.assert_close(out[1], want[0].float(), atol=1e-5, rtol=1e-5)
    assert torch.equal(cache_k, before)


@pytest.mark.parametrize("kwargs, match", [
    (dict(k="only"), "k and v go together"),
    (dict(rotary="no_k"), "rotate the new keys"),
    (dict(cache_seqlens=39), "do not fit"),
    (dict(k="both"), "cache_seqlens .* is required"),
])
def test_bad_inputs_are_named(kwargs, match):
    q, cache_k, cache_v, k_new, v_new = make_case()
    call = dict(cache_seqlens=kwargs.get("cache_seqlens"))
    if kwargs.get("k") == "only":
        call["k"] = k_new
    if kwargs.get("k") == "both" or "cache_seqlens" in kwargs:
        call.update(k=k_new, v=v_new)
    if kwargs.get("rotary") == "no_k":
        call.update(zip(("rotary_cos", "rotary_sin"), rotary_tables(16)))
    with pytest.raises(ValueError, match=match):
        kvcache_forward_reference(q, cache_k, cache_v, **call)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (7, 2))])
@pytest.mark.parametrize("boundaries", [[0, 61], [0, 0, 17, 17, 40, 61], [0, 1, 2, 60, 61]])
def test_split_partials_combine_to_the_whole(causal, window, boundaries):
    """Any cut of the keys, empty splits and splits a row sees nothing of included, combines
    to the unsplit attention (rows 0-2 of a causal 5 x 61 problem see none of the last split)."""
    from flash_cuda.reference import attention_forward_reference
    from flash_cuda.reference_kvcache import combine_reference, split_partials_reference
    q, k, v = torch.randn(2, 5, HQ, D), torch.randn(2, 61, HK, D), torch.randn(2, 61, HK, D)
    scale = D ** -0.5
    out_p, lse_p = split_partials_reference(q, k, v, boundaries, scale, causal, window)
    assert out_p.shape == (len(boundaries) - 1, 2, 5, HQ, D) and lse_p.shape == (len(boundaries) - 1, 2, 5, HQ)
    out, lse = combine_reference(out_p, lse_p)
    want_out, want_lse = attention_forward_reference(q, k, v, softmax_scale=scale, causal=causal,
                                                     window_left=window[0],
                                                     window_right=window[1])
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_combine_ignores_what_an_unseen_split_holds():
    """A split with lse -inf weighs nothing, even when its out holds NaN; a row no split saw
    gets out 0 and lse -inf."""
    from flash_cuda.reference_kvcache import combine_reference
    out_p = torch.randn(3, 4, D)
    lse_p = torch.randn(3, 4)
    out_p[1, :2] = float("nan")
    lse_p[1, :2] = float("-inf")
    lse_p[:, 3] = float("-inf")
    out, lse = combine_reference(out_p, lse_p, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (out[3] == 0).all() and lse[3] == float("-inf")
    w = torch.softmax(lse_p[[0, 2], 0], dim=0)
    torch.testing.assert_close(out[0].float(), (w[0] * out_p[0, 0] + w[1] * out_p[2, 0]),
                               atol=1e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="lse_partial must have"):
        combine_reference(out_p, lse_p[:, :2])
