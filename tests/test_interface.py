"""Tests of the user API (flash_cuda/interface.py and the checks behind it) on the CPU.

Results and gradients of every entry point are compared with the float64 oracle
flash_cuda.reference.attention_naive, differentiated by autograd; every rejected input is
checked for the exception type and for a message that names the offending argument.
"""

import inspect
import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_cuda
from flash_cuda import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)
from flash_cuda.reference import attention_naive

HEAD_DIM = 16
# name -> (causal, window_size)
MASKS = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "local_3_0": (False, (3, 0)),
    "local_5_2": (False, (5, 2)),
    "causal_left_6": (True, (6, -1)),
}
HEADS = [(4, 4), (4, 2), (4, 1)]  # (heads_q, heads_kv): MHA, GQA, MQA
OUT_TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=5e-5, rtol=1e-4)


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def _naive_kwargs(causal, window_size, softmax_scale=None):
    left, right = window_size
    return dict(causal=causal, window_left=left, window_right=right, softmax_scale=softmax_scale)


def _oracle(q, k, v, dout, **kw):
    """float64 out, lse and autograd gradients of attention_naive."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = attention_naive(*leaves, **kw)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return out.detach(), lse.detach(), grads


def _run(fn, tensors, dout, *args, **kw):
    """Calls fn on fresh leaves of `tensors`; returns out, lse and the leaves' gradients."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out, lse = fn(*leaves, *args, return_attn_probs=True, **kw)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), lse, grads


def _assert_lse_close(actual, expected, **tol):
    """Same -inf pattern and close where finite."""
    assert actual.dtype == torch.float32 and not torch.isnan(actual).any()
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite].double(), expected[finite], **(tol or OUT_TOL))


def _assert_matches_oracle(result, oracle, out_tol=OUT_TOL, grad_tol=GRAD_TOL):
    out, lse, grads = result
    out_o, lse_o, grads_o = oracle
    torch.testing.assert_close(out.double(), out_o, **out_tol)
    _assert_lse_close(lse, lse_o, **out_tol)
    for g, g_o in zip(grads, grads_o):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g.double(), g_o, **grad_tol)


def _dense(batch, q_len, k_len, heads, gen, dtype=torch.float32, d=HEAD_DIM):
    heads_q, heads_kv = heads
    q = _randn(batch, q_len, heads_q, d, gen=gen, dtype=dtype)
    k = _randn(batch, k_len, heads_kv, d, gen=gen, dtype=dtype)
    v = _randn(batch, k_len, heads_kv, d, gen=gen, dtype=dtype)
    dout = _randn(batch, q_len, heads_q, d, gen=gen, dtype=dtype)
    return q, k, v, dout


@pytest.mark.fast
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("q_len,k_len", [(1, 1), (17, 17), (23, 9), (9, 23)])
def test_dense_matches_oracle(q_len, k_len, mask, heads):
    gen = torch.Generator().manual_seed(q_len * 100 + k_len)
    q, k, v, dout = _dense(2, q_len, k_len, heads, gen)
    causal, window = MASKS[mask]
    result = _run(flash_attn_func, (q, k, v), dout, causal=causal, window_size=window)
    assert result[0].shape == q.shape and result[0].dtype == q.dtype
    assert result[1].shape == (2, heads[0], q_len)
    _assert_matches_oracle(result, _oracle(q, k, v, dout, **_naive_kwargs(causal, window)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_matches_oracle(dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = _dense(2, 33, 40, (4, 2), gen, dtype=dtype)
    result = _run(flash_attn_func, (q, k, v), dout, causal=True)
    assert result[0].dtype == dtype and all(g.dtype == dtype for g in result[2])
    tol = dict(atol=2e-2, rtol=2e-2)
    _assert_matches_oracle(result, _oracle(q, k, v, dout, causal=True), tol, tol)


def test_softmax_scale_default_and_explicit():
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = _dense(1, 12, 12, (2, 2), gen, d=64)
    default = flash_attn_func(q, k, v)
    explicit = flash_attn_func(q, k, v, softmax_scale=64 ** -0.5)
    torch.testing.assert_close(default, explicit, atol=0, rtol=0)
    result = _run(flash_attn_func, (q, k, v), dout, softmax_scale=0.3)
    _assert_matches_oracle(result, _oracle(q, k, v, dout, softmax_scale=0.3))


def test_return_attn_probs():
    gen = torch.Generator().manual_seed(3)
    q, k, v, _ = _dense(2, 6, 8, (4, 2), gen)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    out2, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    torch.testing.assert_close(out, out2, atol=0, rtol=0)
    assert lse.shape == (2, 4, 6) and lse.dtype == torch.float32 and not lse.requires_grad


def test_rows_without_keys_are_zero():
    """Causal with seqlen_q > seqlen_k: the first rows see no key (bottom-right alignment)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, dout = _dense(2, 20, 7, (2, 1), gen)
    out, lse, (dq, dk, dv) = _run(flash_attn_func, (q, k, v), dout, causal=True)
    assert (out[:, :13] == 0).all() and torch.isneginf(lse[:, :, :13]).all()
    assert (dq[:, :13] == 0).all() and torch.isfinite(lse[:, :, 13:]).all()
    assert not any(torch.isnan(t).any() for t in (out, dq, dk, dv))


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _varlen(q_lens, k_lens, heads, gen, pad=0):
    """Packed q, k, v, dout with `pad` trailing rows that no sequence owns."""
    heads_q, heads_kv = heads
    q = _randn(sum(q_lens) + pad, heads_q, HEAD_DIM, gen=gen)
    k = _randn(sum(k_lens) + pad, heads_kv, HEAD_DIM, gen=gen)
    v = _randn(sum(k_lens) + pad, heads_kv, HEAD_DIM, gen=gen)
    dout = _randn(sum(q_lens) + pad, heads_q, HEAD_DIM, gen=gen)
    return q, k, v, dout


def _check_varlen_sequences(result, q, k, v, dout, q_lens, k_lens, used_q, used_k, naive_kw):
    """Each used sequence matches the oracle on its slice; all other rows are empty."""
    out, lse, (dq, dk, dv) = result
    cu_q, cu_k = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    q_attends = torch.zeros(q.shape[0], dtype=torch.bool)
    k_attended = torch.zeros(k.shape[0], dtype=torch.bool)
    for b in range(len(q_lens)):
        if used_q[b] == 0 or used_k[b] == 0:
            continue  # nothing attends here: the emptiness checks below cover these rows
        qs = slice(cu_q[b], cu_q[b] + used_q[b])
        ks = slice(cu_k[b], cu_k[b] + used_k[b])
        q_attends[qs], k_attended[ks] = True, True
        oracle = _oracle(q[None, qs], k[None, ks], v[None, ks], dout[None, qs], **naive_kw)
        grads = (dq[None, qs], dk[None, ks], dv[None, ks])
        _assert_matches_oracle((out[None, qs], lse[None, :, qs], grads), oracle)
    assert (out[~q_attends] == 0).all() and torch.isneginf(lse[:, ~q_attends]).all()
    assert (dq[~q_attends] == 0).all()
    assert (dk[~k_attended] == 0).all() and (dv[~k_attended] == 0).all()


@pytest.mark.fast
@pytest.mark.parametrize("heads", [(2, 2), (4, 1)], ids=lambda h: f"hq{h[0]}_hkv{h[1]}")
@pytest.mark.parametrize("mask", ["full", "causal", "local_3_0", "local_5_2"])
def test_varlen_matches_oracle(mask, heads):
    q_lens, k_lens = [0, 1, 17, 5, 1, 9], [3, 0, 17, 1, 1, 12]
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = _varlen(q_lens, k_lens, heads, gen, pad=2)
    causal, window = MASKS[mask]
    result = _run(flash_attn_varlen_func, (q, k, v), dout, _cu(q_lens), _cu(k_lens),
                  max(q_lens), max(k_lens), causal=causal, window_size=window)
    assert result[0].shape == q.shape and result[1].shape == (heads[0], q.shape[0])
    _check_varlen_sequences(result, q, k, v, dout, q_lens, k_lens, q_lens, k_lens,
                            _naive_kwargs(causal, window))


@pytest.mark.parametrize("mask", ["full", "causal"])
def test_varlen_seqused(mask):
    q_lens, k_lens = [4, 17, 9, 6], [6, 17, 30, 3]
    used_q, used_k = [4, 10, 0, 5], [2, 17, 25, 0]
    gen = torch.Generator().manual_seed(6)
    q, k, v, dout = _varlen(q_lens, k_lens, (4, 2), gen)
    causal, window = MASKS[mask]
    result = _run(flash_attn_varlen_func, (q, k, v), dout, _cu(q_lens), _cu(k_lens),
                  max(q_lens), max(k_lens), seqused_q=torch.tensor(used_q, dtype=torch.int32),
                  seqused_k=torch.tensor(used_k, dtype=torch.int32), causal=causal,
                  window_size=window)
    _check_varlen_sequences(result, q, k, v, dout, q_lens, k_lens, used_q, used_k,
                            _naive_kwargs(causal, window))


def test_qkvpacked_matches_unpacked():
    gen = torch.Generator().manual_seed(7)
    qkv = _randn(2, 11, 3, 4, HEAD_DIM, gen=gen)
    dout = _randn(2, 11, 4, HEAD_DIM, gen=gen)
    leaf = qkv.clone().requires_grad_()
    out, lse = flash_attn_qkvpacked_func(leaf, causal=True, return_attn_probs=True)
    (dqkv,) = torch.autograd.grad(out, leaf, dout)
    q, k, v = qkv.unbind(2)
    expected = _oracle(q, k, v, dout, causal=True)
    _assert_matches_oracle((out, lse, dqkv.unbind(2)), expected)


def test_qkvpacked_with_num_heads_q():
    """FlashAttention-3's GQA packing: (batch, seqlen, heads_q + 2 * heads_kv, d)."""
    gen = torch.Generator().manual_seed(8)
    qkv = _randn(2, 9, 4 + 2 * 2, HEAD_DIM, gen=gen)
    dout = _randn(2, 9, 4, HEAD_DIM, gen=gen)
    leaf = qkv.clone().requires_grad_()
    out, lse = flash_attn_qkvpacked_func(leaf, window_size=(2, 1), num_heads_q=4,
                                         return_attn_probs=True)
    (dqkv,) = torch.autograd.grad(out, leaf, dout)
    q, k, v = qkv.split([4, 2, 2], dim=2)
    expected = _oracle(q, k, v, dout, window_left=2, window_right=1)
    _assert_matches_oracle((out, lse, dqkv.split([4, 2, 2], dim=2)), expected)


def test_kvpacked_matches_unpacked():
    gen = torch.Generator().manual_seed(9)
    q = _randn(2, 7, 4, HEAD_DIM, gen=gen)
    kv = _randn(2, 13, 2, 2, HEAD_DIM, gen=gen)
    dout = _randn(2, 7, 4, HEAD_DIM, gen=gen)
    q_leaf, kv_leaf = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out, lse, s_dmask = flash_attn_kvpacked_func(q_leaf, kv_leaf, causal=True,
                                                 return_attn_probs=True)
    assert s_dmask is None  # FlashAttention-2's dropout mask, absent without dropout
    dq, dkv = torch.autograd.grad(out, (q_leaf, kv_leaf), dout)
    k, v = kv.unbind(2)
    _assert_matches_oracle((out, lse, (dq, *dkv.unbind(2))), _oracle(q, k, v, dout, causal=True))


def _strided(shape, gen):
    """A tensor of `shape` whose last dim is contiguous but whose other strides are not:
    (..., heads, rows, 2 * d) transposed to (..., rows, heads, 2 * d), then sliced."""
    *outer, rows, heads, d = shape
    base = _randn(*outer, heads, rows + 3, 2 * d, gen=gen).transpose(-3, -2)
    return base[..., 2:2 + rows, :, 8:8 + d]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_strided_inputs_match_contiguous(varlen):
    gen = torch.Generator().manual_seed(10)
    lead_q, lead_k = ((20,), (26,)) if varlen else ((2, 10), (2, 13))
    q = _strided((*lead_q, 4, HEAD_DIM), gen)
    k = _strided((*lead_k, 2, HEAD_DIM), gen)
    v = _strided((*lead_k, 2, HEAD_DIM), gen)
    # dout with a non-unit last stride must be accepted too (it is copied).
    dout = _randn(*lead_q, HEAD_DIM, 4, gen=gen).transpose(-1, -2)
    assert not q.is_contiguous() and q.stride(-1) == 1 and dout.stride(-1) != 1
    args = (_cu([8, 12]), _cu([10, 16]), 12, 16) if varlen else ()
    fn = flash_attn_varlen_func if varlen else flash_attn_func
    strided = _run(fn, (q, k, v), dout, *args, causal=True)
    contiguous = _run(fn, (q.contiguous(), k.contiguous(), v.contiguous()), dout.contiguous(),
                      *args, causal=True)
    for a, b in zip((strided[0], strided[1], *strided[2]),
                    (contiguous[0], contiguous[1], *contiguous[2])):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_hints_and_deterministic_do_not_change_results():
    gen = torch.Generator().manual_seed(11)
    q, k, v, dout = _dense(2, 9, 9, (4, 2), gen)
    base = _run(flash_attn_func, (q, k, v), dout, causal=True)
    hinted = _run(flash_attn_func, (q, k, v), dout, causal=True, num_splits=0, pack_gqa=True,
                  sm_margin=8, deterministic=True)
    for a, b in zip((base[0], base[1], *base[2]), (hinted[0], hinted[1], *hinted[2])):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


FA3_DENSE_ORDER = ["q", "k", "v", "softmax_scale", "causal", "qv", "q_descale", "k_descale",
                   "v_descale", "window_size", "attention_chunk", "softcap", "num_splits",
                   "pack_gqa", "deterministic", "sm_margin", "return_attn_probs"]
FA3_VARLEN_ORDER = (FA3_DENSE_ORDER[:3] + ["cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                           "max_seqlen_k", "seqused_q", "seqused_k"]
                    + FA3_DENSE_ORDER[3:])
API = [flash_attn_func, flash_attn_varlen_func, flash_attn_qkvpacked_func,
       flash_attn_kvpacked_func]


def test_signatures_follow_flash_attention_and_agree():
    """FlashAttention-3's positional order, and one default per shared keyword across the API."""
    for fn, order in ((flash_attn_func, FA3_DENSE_ORDER),
                      (flash_attn_varlen_func, FA3_VARLEN_ORDER)):
        assert list(inspect.signature(fn).parameters)[:len(order)] == order
    defaults = {}
    for fn in API:
        for name, param in inspect.signature(fn).parameters.items():
            if param.default is not inspect.Parameter.empty:
                assert defaults.setdefault(name, param.default) == param.default, name
    assert defaults["dropout_p"] == 0.0 and defaults["alibi_slopes"] is None


def test_package_exports():
    assert flash_cuda.__version__ == "0.1.0"
    for fn in API:
        assert getattr(flash_cuda, fn.__name__) is fn and fn.__doc__
    assert "cpu" in flash_cuda.build_info()["devices"]


def test_kvpacked_follows_flash_attention_2():
    """FlashAttention-2's positional order: (q, kv, dropout_p, softmax_scale, causal, ...)."""
    assert list(inspect.signature(flash_attn_kvpacked_func).parameters) == [
        "q", "kv", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
        "alibi_slopes", "deterministic", "return_attn_probs"]
    gen = torch.Generator().manual_seed(20)
    q, kv = _randn(2, 7, 4, HEAD_DIM, gen=gen), _randn(2, 9, 2, 2, HEAD_DIM, gen=gen)
    expected = flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], 0.3, True, window_size=(4, 0))
    actual = flash_attn_kvpacked_func(q, kv, 0.0, 0.3, True, (4, 0))
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)


class _NumpyLike:
    """Stand-ins for numpy scalars when numpy is absent: an integer with __index__."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


def _integer_likes(value):
    """The integer-likes FlashAttention-3 accepts for max_seqlen (its C++ binding converts
    them): Python int, numpy integer, 0-d and 1-element integer tensors."""
    likes = [value, torch.tensor(value), torch.tensor([value], dtype=torch.int32)]
    try:
        import numpy as np
        likes += [np.int64(value), np.int32(value)]
    except ImportError:
        pass
    return likes


def test_fa3_argument_conversions_give_the_same_result():
    gen = torch.Generator().manual_seed(21)
    q_lens, k_lens = [3, 7, 5], [4, 9, 2]
    q, k, v, _ = _varlen(q_lens, k_lens, (4, 2), gen)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)
    expected = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 9, softmax_scale=0.25,
                                      causal=True, window_size=(3, 0))
    windows = [[3, 0], (3, 0), torch.tensor([3, 0]), torch.tensor([3, 0], dtype=torch.int32)]
    scales = [0.25, torch.tensor(0.25).item()]
    flags = [True, torch.tensor(True)]
    try:
        import numpy as np
        windows += [np.array([3, 0]), (np.int64(3), np.int32(0))]
        scales += [np.float32(0.25), np.float64(0.25)]
        flags += [np.bool_(True)]
    except ImportError:
        pass
    for max_q, max_k in zip(_integer_likes(7), _integer_likes(9)):
        for window in windows:
            for scale in scales:
                for causal in flags:
                    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k,
                                                 softmax_scale=scale, causal=causal,
                                                 window_size=window)
                    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_integer_scale_is_a_float_like():
    gen = torch.Generator().manual_seed(22)
    q, k, v, _ = _dense(1, 6, 6, (2, 2), gen)
    torch.testing.assert_close(flash_attn_func(q, k, v, softmax_scale=1),
                               flash_attn_func(q, k, v, softmax_scale=1.0), atol=0, rtol=0)


def test_last_dim_strided_inputs_are_copied_once():
    """A non-unit last stride is not an error: the input is copied (as FlashAttention-3 does)."""
    gen = torch.Generator().manual_seed(23)
    q, k, v, dout = _dense(2, 9, 11, (4, 2), gen)
    strided = [torch.stack([t, torch.full_like(t, float("nan"))], dim=-1)[..., 0]
               for t in (q, k, v)]
    assert all(t.stride(-1) == 2 for t in strided)
    _assert_matches_oracle(_run(flash_attn_func, strided, dout, causal=True),
                           _oracle(q, k, v, dout, causal=True))


def test_outputs_take_the_layout_of_their_inputs():
    """out and dq mirror q, dk k, dv v when those are dense: SDPA's (b, h, s, d) tensors viewed as
    (b, s, h, d) give outputs that view back to (b, h, s, d) contiguous."""
    gen = torch.Generator().manual_seed(24)
    bhsd = [_randn(2, h, n, HEAD_DIM, gen=gen) for h, n in ((4, 9), (2, 11), (2, 11))]
    leaves = [t.requires_grad_() for t in bhsd]
    out = flash_attn_func(*(t.transpose(1, 2) for t in leaves), causal=True)
    assert out.transpose(1, 2).is_contiguous()
    out.backward(torch.ones_like(out))
    assert all(t.grad.is_contiguous() for t in leaves)


def _valid_dense():
    gen = torch.Generator().manual_seed(12)
    q, k, v, _ = _dense(2, 5, 7, (4, 2), gen)
    return dict(q=q, k=k, v=v)


def _valid_varlen():
    gen = torch.Generator().manual_seed(13)
    q, k, v, _ = _varlen([2, 3], [4, 3], (4, 2), gen)
    return dict(q=q, k=k, v=v, cu_seqlens_q=_cu([2, 3]), cu_seqlens_k=_cu([4, 3]),
                max_seqlen_q=3, max_seqlen_k=4)


# ---- rejected inputs: tests/test_checks.py ---------------------------------------------------

def test_deterministic_backward_on_cuda_is_checked_at_the_call():
    """Where the CUDA backward is not deterministic, deterministic=True fails in the forward
    call when gradients will be needed, and is harmless otherwise. Fake CUDA tensors stand in
    for a GPU: the check reads only devices and flags."""
    supported = flash_cuda.build_info()["features"]["deterministic_backward"]
    with FakeTensorMode():
        q = torch.empty(1, 4, 2, HEAD_DIM, device="cuda", dtype=torch.float16)
        flash_attn_func(q, q, q, deterministic=True)  # no gradient needed
        q.requires_grad_()
        if supported:
            flash_attn_func(q, q, q, deterministic=True)
        else:
            with pytest.raises(NotImplementedError, match="^deterministic=True"):
                flash_attn_func(q, q, q, deterministic=True)
            with torch.no_grad():
                flash_attn_func(q, q, q, deterministic=True)
        flash_attn_func(q, q, q, deterministic=False)


def test_deterministic_algorithms_count_as_deterministic_true():
    """torch.use_deterministic_algorithms(True) is honoured like deterministic=True; with
    warn_only=True the call goes ahead (the backward warns, as torch's own ops do)."""
    supported = flash_cuda.build_info()["features"]["deterministic_backward"]
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        with FakeTensorMode():
            q = torch.empty(1, 4, 2, HEAD_DIM, device="cuda", dtype=torch.float16,
                            requires_grad=True)
            torch.use_deterministic_algorithms(True)
            if not supported:
                with pytest.raises(NotImplementedError, match="use_deterministic_algorithms"):
                    flash_attn_func(q, q, q)
            torch.use_deterministic_algorithms(True, warn_only=True)
            flash_attn_func(q, q, q)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _packed_call(fn, **kw):
    gen = torch.Generator().manual_seed(14)
    if fn is flash_attn_qkvpacked_func:
        return lambda: fn(_randn(1, 4, 3, 2, HEAD_DIM, gen=gen), **kw)
    if fn is flash_attn_kvpacked_func:
        return lambda: fn(_randn(1, 4, 2, HEAD_DIM, gen=gen),
                          _randn(1, 4, 2, 2, HEAD_DIM, gen=gen), **kw)
    if fn is flash_attn_varlen_func:
        return lambda: fn(**_valid_varlen(), **kw)
    return lambda: fn(**_valid_dense(), **kw)


@pytest.mark.parametrize("fn", API, ids=lambda f: f.__name__)
@pytest.mark.parametrize("name,value", [("dropout_p", 0.25), ("alibi_slopes", torch.ones(4))],
                         ids=["dropout_p", "alibi_slopes"])
def test_flash_attention_2_keywords(fn, name, value):
    """Every entry point takes FlashAttention-2's dropout_p / alibi_slopes at their defaults
    and rejects anything else."""
    default = inspect.signature(fn).parameters[name].default
    out = _packed_call(fn, **{name: default})()
    assert not torch.isnan(out).any()
    with pytest.raises(NotImplementedError, match=f"^{name}="):
        _packed_call(fn, **{name: value})()
