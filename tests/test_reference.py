"""Tests of flash_cuda/reference.py, the plain-PyTorch attention every kernel is checked against.

The chunked online-softmax reference is compared with a float64 oracle that materialises all
scores (forward) and with autograd through that oracle (backward); varlen and seqused are
compared with the dense reference run sequence by sequence. CPU only.
"""

import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import torch

try:
    from flash_cuda import reference as ref
except (ImportError, OSError):
    # The package __init__ may pull in the compiled extension, which these tests do not need.
    _spec = importlib.util.spec_from_file_location(
        "flash_cuda_reference", Path(__file__).resolve().parents[1] / "flash_cuda" / "reference.py"
    )
    ref = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(ref)

HEAD_DIM = 16
CHUNK = 16  # smaller than most sequence lengths below, so the key loop runs several chunks

# (causal, window_left, window_right)
MASKS = {
    "full": (False, -1, -1),
    "causal": (True, -1, -1),
    "local_3_0": (False, 3, 0),
    "local_5_2": (False, 5, 2),
    "local_0_0": (False, 0, 0),
    "local_n1_4": (False, -1, 4),
    "causal_left_6": (True, 6, -1),
}
SEQLENS = [(1, 1), (17, 17), (113, 113), (17, 113), (113, 17), (1, 17), (17, 1)]
HEADS = [(4, 4), (4, 2), (4, 1)]  # (heads_q, heads_kv): MHA, GQA 2, MQA


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def _mask_kwargs(name):
    causal, window_left, window_right = MASKS[name]
    return dict(causal=causal, window_left=window_left, window_right=window_right)


def _naive_with_grads(q, k, v, dout, **kw):
    """Oracle out, lse and float64 autograd gradients for a dense problem."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = ref.attention_naive(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return out.detach(), lse.detach(), grads


def _reference_with_grads(q, k, v, dout, **kw):
    out, lse = ref.attention_forward_reference(q, k, v, **kw)
    grads = ref.attention_backward_reference(dout, q, k, v, out, lse, **kw)
    return out, lse, grads


def _assert_close_lse(actual, expected, atol=1e-5, rtol=1e-5):
    """Same -inf pattern, and close where finite."""
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(torch.isneginf(actual), torch.isneginf(expected.to(actual.device)))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite].double(), expected[finite].double(),
                               atol=atol, rtol=rtol)


def _assert_no_nan(*tensors):
    for t in tensors:
        assert not torch.isnan(t).any()


@pytest.mark.parametrize("q_len,k_len", [(1, 1), (5, 5), (4, 9), (9, 4), (0, 3), (3, 0)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (3, 0), (5, 2), (0, 0), (-1, 4), (2, -1)])
def test_visible_mask_matches_definition(q_len, k_len, window):
    left, right = window

    def sees(i, j):
        # The spec's definition, one (row, key) pair at a time.
        shift = k_len - q_len
        return (left < 0 or j >= i + shift - left) and (right < 0 or j <= i + shift + right)

    expected = torch.tensor([[sees(i, j) for j in range(k_len)] for i in range(q_len)],
                            dtype=torch.bool).reshape(q_len, k_len)
    torch.testing.assert_close(ref.visible_mask(q_len, k_len, 0, k_len, window, "cpu"), expected)
    if k_len > 2:
        sub = ref.visible_mask(q_len, k_len, 1, k_len - 1, window, "cpu")
        torch.testing.assert_close(sub, expected[:, 1:k_len - 1])


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("q_len,k_len", SEQLENS)
def test_dense_matches_naive(q_len, k_len, mask, heads):
    gen = torch.Generator().manual_seed(q_len * 1000 + k_len)
    heads_q, heads_kv = heads
    q = _randn(2, q_len, heads_q, HEAD_DIM, gen=gen)
    k = _randn(2, k_len, heads_kv, HEAD_DIM, gen=gen)
    v = _randn(2, k_len, heads_kv, HEAD_DIM, gen=gen)
    dout = _randn(2, q_len, heads_q, HEAD_DIM, gen=gen)
    kw = _mask_kwargs(mask)
    out, lse, grads = _reference_with_grads(q, k, v, dout, chunk_size=CHUNK, **kw)
    out_n, lse_n, grads_n = _naive_with_grads(q, k, v, dout, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (2, heads_q, q_len) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
    _assert_close_lse(lse, lse_n)
    for g, g_n, t in zip(grads, grads_n, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype
        torch.testing.assert_close(g.double(), g_n, atol=5e-5, rtol=1e-4)
    _assert_no_nan(out, *grads)


def test_softmax_scale_and_head_dim():
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (_randn(1, 29, 2, 64, gen=gen) for _ in range(4))
    for scale in (None, 0.3):
        out, lse, grads = _reference_with_grads(q, k, v, dout, softmax_scale=scale, causal=True,
                                                chunk_size=8)
        out_n, lse_n, grads_n = _naive_with_grads(q, k, v, dout, softmax_scale=scale, causal=True)
        torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
        _assert_close_lse(lse, lse_n)
        for g, g_n in zip(grads, grads_n):
            torch.testing.assert_close(g.double(), g_n, atol=5e-5, rtol=1e-4)
    default = ref.attention_forward_reference(q, k, v)[0]
    explicit = ref.attention_forward_reference(q, k, v, softmax_scale=1 / math.sqrt(64))[0]
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)


@pytest.mark.parametrize("mask", ["full", "causal", "local_5_2"])
def test_chunk_size_does_not_change_results(mask):
    gen = torch.Generator().manual_seed(11)
    q, dout = _randn(2, 50, 4, HEAD_DIM, gen=gen), _randn(2, 50, 4, HEAD_DIM, gen=gen)
    k, v = _randn(2, 70, 2, HEAD_DIM, gen=gen), _randn(2, 70, 2, HEAD_DIM, gen=gen)
    base = _reference_with_grads(q, k, v, dout, chunk_size=1024, **_mask_kwargs(mask))
    for chunk_size in (1, 7, 64):
        other = _reference_with_grads(q, k, v, dout, chunk_size=chunk_size, **_mask_kwargs(mask))
        for a, b in zip((base[0], base[1], *base[2]), (other[0], other[1], *other[2])):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _check_varlen_against_dense(q, k, v, dout, q_lens, k_lens, used_q, used_k, kw):
    """Runs varlen once and the dense reference per sequence; padding rows must stay empty."""
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    seqused = dict(
        seqused_q=None if used_q is None else torch.tensor(used_q, dtype=torch.int32),
        seqused_k=None if used_k is None else torch.tensor(used_k, dtype=torch.int32),
    )
    out, lse, (dq, dk, dv) = _reference_with_grads(q, k, v, dout, cu_seqlens_q=cu_q,
                                                   cu_seqlens_k=cu_k, chunk_size=4, **seqused, **kw)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    _assert_no_nan(out, lse, dq, dk, dv)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    q_seen = torch.zeros(q.shape[0], dtype=torch.bool)
    k_seen = torch.zeros(k.shape[0], dtype=torch.bool)
    for b in range(len(q_lens)):
        qs = slice(cu_q[b], cu_q[b] + (q_lens[b] if used_q is None else used_q[b]))
        ks = slice(cu_k[b], cu_k[b] + (k_lens[b] if used_k is None else used_k[b]))
        q_seen[qs], k_seen[ks] = True, True
        o_b, l_b, g_b = _reference_with_grads(q[None, qs], k[None, ks], v[None, ks],
                                              dout[None, qs], chunk_size=4, **kw)
        torch.testing.assert_close(out[qs], o_b[0], atol=1e-6, rtol=1e-6)
        _assert_close_lse(lse[:, qs], l_b[0], atol=1e-6, rtol=1e-6)
        for g, g_ref, s in zip((dq, dk, dv), g_b, (qs, ks, ks)):
            torch.testing.assert_close(g[s], g_ref[0], atol=1e-6, rtol=1e-6)
    # Rows outside every used range: out 0, lse -inf, no gradient; keys outside: dk = dv = 0.
    assert (out[~q_seen] == 0).all() and torch.isneginf(lse[:, ~q_seen]).all()
    assert (dq[~q_seen] == 0).all()
    assert (dk[~k_seen] == 0).all() and (dv[~k_seen] == 0).all()


@pytest.mark.parametrize("mask", ["full", "causal", "local_3_0", "local_0_0", "local_n1_4"])
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
def test_varlen_matches_dense_per_sequence(mask, heads):
    q_lens, k_lens = [0, 1, 17, 5, 33, 1], [3, 0, 17, 1, 40, 1]
    gen = torch.Generator().manual_seed(3)
    heads_q, heads_kv = heads
    # Two padding tokens past cu_seqlens[-1] that no sequence owns.
    q = _randn(sum(q_lens) + 2, heads_q, HEAD_DIM, gen=gen)
    dout = _randn(sum(q_lens) + 2, heads_q, HEAD_DIM, gen=gen)
    k = _randn(sum(k_lens) + 2, heads_kv, HEAD_DIM, gen=gen)
    v = _randn(sum(k_lens) + 2, heads_kv, HEAD_DIM, gen=gen)
    _check_varlen_against_dense(q, k, v, dout, q_lens, k_lens, None, None, _mask_kwargs(mask))


@pytest.mark.parametrize("mask", ["full", "causal", "local_5_2"])
def test_varlen_seqused(mask):
    q_lens, k_lens = [4, 17, 9, 20], [6, 17, 30, 3]
    used_q, used_k = [4, 10, 0, 13], [2, 17, 25, 0]
    gen = torch.Generator().manual_seed(5)
    q, dout = (_randn(sum(q_lens), 4, HEAD_DIM, gen=gen) for _ in range(2))
    k, v = (_randn(sum(k_lens), 2, HEAD_DIM, gen=gen) for _ in range(2))
    _check_varlen_against_dense(q, k, v, dout, q_lens, k_lens, used_q, used_k, _mask_kwargs(mask))


@pytest.mark.parametrize("mask", ["full", "causal", "local_3_0"])
def test_dense_seqused_matches_naive_on_prefix(mask):
    gen = torch.Generator().manual_seed(9)
    used_q, used_k = [20, 7, 0], [33, 1, 12]
    q, dout = (_randn(3, 20, 4, HEAD_DIM, gen=gen) for _ in range(2))
    k, v = (_randn(3, 33, 2, HEAD_DIM, gen=gen) for _ in range(2))
    kw = _mask_kwargs(mask)
    out, lse, (dq, dk, dv) = _reference_with_grads(
        q, k, v, dout, seqused_q=torch.tensor(used_q, dtype=torch.int32),
        seqused_k=torch.tensor(used_k, dtype=torch.int32), chunk_size=8, **kw)
    _assert_no_nan(out, lse, dq, dk, dv)
    for b, (lq, lk) in enumerate(zip(used_q, used_k)):
        out_n, lse_n, grads_n = _naive_with_grads(q[b:b + 1, :lq], k[b:b + 1, :lk],
                                                  v[b:b + 1, :lk], dout[b:b + 1, :lq], **kw)
        torch.testing.assert_close(out[b:b + 1, :lq].double(), out_n, atol=1e-5, rtol=1e-5)
        _assert_close_lse(lse[b:b + 1, :, :lq], lse_n)
        for g, g_n, length in zip((dq, dk, dv), grads_n, (lq, lk, lk)):
            torch.testing.assert_close(g[b:b + 1, :length].double(), g_n, atol=5e-5, rtol=1e-4)
        assert (out[b, lq:] == 0).all() and torch.isneginf(lse[b, :, lq:]).all()
        assert (dq[b, lq:] == 0).all()
        assert (dk[b, lk:] == 0).all() and (dv[b, lk:] == 0).all()


@pytest.mark.parametrize(
    "q_len,k_len,mask,empty_rows",
    [
        (20, 7, "local_0_0", 13),  # row i sees only key i - 13
        (20, 7, "causal", 13),
        (20, 7, "local_3_0", 13),
        (9, 0, "full", 9),  # no keys at all
    ],
)
def test_rows_without_visible_keys(q_len, k_len, mask, empty_rows):
    gen = torch.Generator().manual_seed(13)
    q, dout = (_randn(2, q_len, 4, HEAD_DIM, gen=gen) for _ in range(2))
    k, v = (_randn(2, k_len, 2, HEAD_DIM, gen=gen) for _ in range(2))
    kw = _mask_kwargs(mask)
    out, lse, (dq, dk, dv) = _reference_with_grads(q, k, v, dout, chunk_size=4, **kw)
    _assert_no_nan(out, lse, dq, dk, dv)
    assert (out[:, :empty_rows] == 0).all() and (dq[:, :empty_rows] == 0).all()
    assert torch.isneginf(lse[:, :, :empty_rows]).all()
    assert torch.isfinite(lse[:, :, empty_rows:]).all()
    if k_len > 0:
        out_n, lse_n, grads_n = _naive_with_grads(q, k, v, dout, **kw)
        _assert_no_nan(out_n, *grads_n)
        torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)
        _assert_close_lse(lse, lse_n)
        for g, g_n in zip((dq, dk, dv), grads_n):
            torch.testing.assert_close(g.double(), g_n, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_low_precision_dtypes(dtype, mask):
    gen = torch.Generator().manual_seed(17)
    q, dout = (_randn(2, 64, 4, HEAD_DIM, gen=gen, dtype=dtype) for _ in range(2))
    k, v = (_randn(2, 80, 2, HEAD_DIM, gen=gen, dtype=dtype) for _ in range(2))
    kw = _mask_kwargs(mask)
    out_n, lse_n, grads_n = _naive_with_grads(q, k, v, dout, **kw)
    errors = {}
    for upcast in (True, False):
        out, lse, grads = _reference_with_grads(q, k, v, dout, upcast=upcast, chunk_size=CHUNK,
                                                **kw)
        assert out.dtype == dtype and lse.dtype == torch.float32
        assert all(g.dtype == dtype for g in grads)
        _assert_no_nan(out, lse, *grads)
        errors[upcast] = [(a.double() - b).abs().max().item()
                          for a, b in zip((out, lse, *grads), (out_n, lse_n, *grads_n))]
    # Upcasting leaves only the final rounding to the input dtype (about 2^-9 relative for
    # bfloat16), so it must beat computing every step in the input dtype.
    for err_up, err_low in zip(errors[True], errors[False]):
        assert err_up < 0.02
        assert err_up < err_low


def test_chunking_bounds_score_memory(monkeypatch):
    """A 4096 x 4096 problem with chunk 256 never forms more than 256 score columns at once."""
    seqlen, chunk = 4096, 256
    gen = torch.Generator().manual_seed(19)
    q, k, v, dout = (_randn(1, seqlen, 1, 8, gen=gen) for _ in range(4))
    widths = []
    real_scores = ref._chunk_scores

    def recording_scores(q_chunk, k_chunk, scale):
        widths.append(k_chunk.shape[-2])
        return real_scores(q_chunk, k_chunk, scale)

    monkeypatch.setattr(ref, "_chunk_scores", recording_scores)
    out, lse, grads = _reference_with_grads(q, k, v, dout, causal=True, chunk_size=chunk)
    assert max(widths) == chunk and sum(widths) == 2 * seqlen  # forward and backward passes
    # Spot-check rows against the float64 oracle; bottom-right alignment makes a row prefix of a
    # square causal problem a problem of its own.
    rows = 300
    out_n, lse_n, grads_n = _naive_with_grads(q[:, :rows], k[:, :rows], v[:, :rows],
                                              dout[:, :rows], causal=True)
    torch.testing.assert_close(out[:, :rows].double(), out_n, atol=1e-5, rtol=1e-5)
    _assert_close_lse(lse[:, :, :rows], lse_n)
    _assert_no_nan(out, lse, *grads)


def test_local_window_skips_invisible_key_chunks(monkeypatch):
    """Key chunks left of every row's window are never visited."""
    widths = []
    real_scores = ref._chunk_scores
    monkeypatch.setattr(ref, "_chunk_scores",
                        lambda q, k, s: widths.append(k.shape[-2]) or real_scores(q, k, s))
    gen = torch.Generator().manual_seed(23)
    q, k, v = (_randn(1, 64, 1, 8, gen=gen) for _ in range(3))
    out, _ = ref.attention_forward_reference(q[:, :8], k, v, causal=True, window_left=4,
                                             chunk_size=8)
    # 8 query rows aligned to the last 8 keys, looking back 4: keys 52..63 only.
    assert sum(widths) == 12
    out_n, _ = ref.attention_naive(q[:, :8], k, v, causal=True, window_left=4)
    torch.testing.assert_close(out.double(), out_n, atol=1e-5, rtol=1e-5)


def test_outputs_mirror_the_layout_of_their_inputs():
    """out / dq take q's layout, dk k's, dv v's (the kernels' rule, Note [Output layout]);
    values do not depend on the layout."""
    gen = torch.Generator().manual_seed(29)
    q = _randn(2, 4, 21, HEAD_DIM, gen=gen).transpose(1, 2)  # (b, s, h, d) with odd strides
    k = _randn(2, 2, 30, HEAD_DIM, gen=gen).transpose(1, 2)
    v = _randn(2, 2, 30, HEAD_DIM, gen=gen).transpose(1, 2)
    dout = _randn(2, 4, 21, HEAD_DIM, gen=gen).transpose(1, 2)
    out, lse, grads = _reference_with_grads(q, k, v, dout, causal=True, chunk_size=CHUNK)
    assert out.stride() == q.stride() and lse.is_contiguous()
    assert [g.stride() for g in grads] == [t.stride() for t in (q, k, v)]
    gapped = torch.stack([q, q], dim=-1)[..., 0]  # last dim not contiguous: contiguous output
    assert ref.output_like(gapped).is_contiguous()
    expected = _reference_with_grads(q.contiguous(), k.contiguous(), v.contiguous(),
                                     dout.contiguous(), causal=True, chunk_size=CHUNK)
    for a, b in zip((out, lse, *grads), (expected[0], expected[1], *expected[2])):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_invalid_inputs_are_rejected():
    q, k = torch.randn(10, 2, 8), torch.randn(12, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="together"):
        ref.attention_forward_reference(q, k, k, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="seqused_k"):
        ref.attention_forward_reference(q, k, k, cu, cu, seqused_k=torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="4-D"):
        ref.attention_forward_reference(q, k, k)
    with pytest.raises(ValueError, match="multiple"):
        ref.attention_forward_reference(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8),
                                        torch.randn(1, 4, 2, 8))
