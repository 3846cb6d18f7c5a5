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
    out, lse = flash_attn_kvpacked_func(q_leaf, kv_leaf, causal=True, return_attn_probs=True)
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


# ---- rejected inputs -------------------------------------------------------------------------

def _valid_dense():
    gen = torch.Generator().manual_seed(12)
    q, k, v, _ = _dense(2, 5, 7, (4, 2), gen)
    return dict(q=q, k=k, v=v)


def _valid_varlen():
    gen = torch.Generator().manual_seed(13)
    q, k, v, _ = _varlen([2, 3], [4, 3], (4, 2), gen)
    return dict(q=q, k=k, v=v, cu_seqlens_q=_cu([2, 3]), cu_seqlens_k=_cu([4, 3]),
                max_seqlen_q=3, max_seqlen_k=4)


def _dense_with(**changes):
    kw = _valid_dense()
    for name, change in changes.items():
        kw[name] = change(kw.get(name))
    return lambda: flash_attn_func(**kw)


def _varlen_with(**changes):
    kw = _valid_varlen()
    for name, change in changes.items():
        kw[name] = change(kw.get(name))
    return lambda: flash_attn_varlen_func(**kw)


def _const(value):
    return lambda _: value


def _all_qkv(transform):
    return dict(q=transform, k=transform, v=transform)


def _with_head_dim(d):
    return lambda t: torch.randn(*t.shape[:-1], d)


def _int_tensor(t):
    return torch.randint(1, 5, t.shape, dtype=torch.int32)


def _last_dim_strided(t):
    return torch.randn(*t.shape[:-1], 2 * t.shape[-1])[..., ::2]


BAD_INPUTS = [
    ("q_not_tensor", _dense_with(q=lambda t: t.tolist()), TypeError, "q must be a torch.Tensor"),
    ("dtype_int32", _dense_with(**_all_qkv(_int_tensor)), ValueError, "q has dtype int32"),
    ("dtype_float64", _dense_with(**_all_qkv(lambda t: t.double())), ValueError,
     "q has dtype float64"),
    ("mixed_dtypes", _dense_with(k=lambda t: t.half()), ValueError,
     "q, k, v must share one dtype.*k float16"),
    ("mixed_devices", _dense_with(k=lambda t: t.to("meta")), ValueError,
     "same device.*k on meta"),
    ("q_rank", _dense_with(q=lambda t: t[0]), ValueError, "q must be 4-D"),
    ("k_last_dim_strided", _dense_with(k=_last_dim_strided), ValueError,
     r"k must be contiguous in its last \(head_dim\) dimension"),
    ("head_dim_7", _dense_with(**_all_qkv(_with_head_dim(7))), ValueError,
     "head dim.*multiple of 8.*got 7"),
    ("head_dim_264", _dense_with(**_all_qkv(_with_head_dim(264))), ValueError,
     "head dim.*between 8 and 256.*got 264"),
    ("head_dim_mismatch", _dense_with(v=_with_head_dim(32)), ValueError,
     "q, k and v must share the head dim"),
    ("heads_not_multiple", _dense_with(q=lambda t: torch.randn(2, 5, 3, HEAD_DIM)), ValueError,
     r"heads of q \(3\) must be a multiple of the number of heads of k and v \(2\)"),
    ("batch_mismatch", _dense_with(q=lambda t: torch.randn(3, 5, 4, HEAD_DIM)), ValueError,
     "same batch size"),
    ("kv_shape_mismatch", _dense_with(v=lambda t: torch.randn(2, 8, 2, HEAD_DIM)), ValueError,
     "k and v must have the same shape"),
    ("varlen_q_rank", _varlen_with(q=lambda t: t[None]), ValueError, "q must be 3-D"),
    ("cu_seqlens_int64", _varlen_with(cu_seqlens_q=lambda t: t.long()), ValueError,
     "cu_seqlens_q must have dtype int32"),
    ("cu_seqlens_wrong_length", _varlen_with(cu_seqlens_k=_const(_cu([4]))), ValueError,
     "cu_seqlens_k must be 1-D with 3 entries"),
    ("cu_seqlens_2d", _varlen_with(cu_seqlens_q=lambda t: t[None]), ValueError,
     "cu_seqlens_q must be 1-D"),
    ("cu_seqlens_decreasing",
     _varlen_with(cu_seqlens_q=_const(torch.tensor([0, 4, 3], dtype=torch.int32))), ValueError,
     r"cu_seqlens_q must be nondecreasing.*cu_seqlens_q\[1\] = 4"),
    ("cu_seqlens_not_from_zero",
     _varlen_with(cu_seqlens_k=_const(torch.tensor([1, 4, 7], dtype=torch.int32))), ValueError,
     "cu_seqlens_k must start at 0"),
    ("cu_seqlens_past_total",
     _varlen_with(cu_seqlens_k=_const(torch.tensor([0, 4, 8], dtype=torch.int32))), ValueError,
     r"cu_seqlens_k\[-1\] = 8 exceeds the 7 rows"),
    ("cu_seqlens_other_device", _varlen_with(cu_seqlens_q=lambda t: t.to("meta")), ValueError,
     "cu_seqlens_q must be on q's device"),
    ("cu_seqlens_strided",
     _varlen_with(cu_seqlens_q=_const(torch.tensor([0, 9, 2, 9, 5], dtype=torch.int32)[::2])),
     ValueError, "cu_seqlens_q must be contiguous"),
    ("cu_seqlens_not_tensor", _varlen_with(cu_seqlens_q=lambda t: t.tolist()), TypeError,
     "cu_seqlens_q must be a torch.Tensor"),
    ("seqused_wrong_length", _varlen_with(seqused_k=_const(torch.ones(3, dtype=torch.int32))),
     ValueError, "seqused_k must be 1-D with 2 entries"),
    ("seqused_int64", _varlen_with(seqused_q=_const(torch.ones(2, dtype=torch.int64))),
     ValueError, "seqused_q must have dtype int32"),
    ("seqused_past_sequence", _varlen_with(seqused_k=_const(torch.tensor([4, 5],
                                                                         dtype=torch.int32))),
     ValueError, r"seqused_k\[1\] = 5 must lie in \[0, 3\]"),
    ("max_seqlen_negative", _varlen_with(max_seqlen_q=_const(-1)), ValueError,
     "max_seqlen_q must be >= 0"),
    ("max_seqlen_float", _varlen_with(max_seqlen_k=_const(4.0)), TypeError,
     "max_seqlen_k must be an int"),
    ("max_seqlen_too_small", _varlen_with(max_seqlen_q=_const(2)), ValueError,
     r"max_seqlen_q = 2 is smaller than the longest sequence in cu_seqlens_q \(3\)"),
    ("window_minus_2", _dense_with(window_size=_const((-2, 0))), ValueError,
     "window_size entries must be >= -1"),
    ("window_not_pair", _dense_with(window_size=_const((3,))), TypeError,
     "window_size must be a pair"),
    ("window_float", _dense_with(window_size=_const((3.0, 0))), TypeError,
     "window_size entries must be ints"),
    ("softmax_scale_nan", _dense_with(softmax_scale=_const(float("nan"))), ValueError,
     "softmax_scale must be a finite number > 0"),
    ("softmax_scale_zero", _dense_with(softmax_scale=_const(0.0)), ValueError,
     "softmax_scale must be a finite number > 0"),
    ("softmax_scale_negative", _dense_with(softmax_scale=_const(-0.5)), ValueError,
     "softmax_scale must be a finite number > 0"),
    ("softmax_scale_underflows_float32", _dense_with(softmax_scale=_const(1e-40)), ValueError,
     r"softmax_scale must be a finite number > 0, within \[1e-30, 1e\+30\]"),
    ("softmax_scale_huge", _dense_with(softmax_scale=_const(1e31)), ValueError,
     "softmax_scale must be a finite number > 0"),
    ("softmax_scale_tensor", _dense_with(softmax_scale=_const(torch.tensor(0.5))), TypeError,
     "softmax_scale must be a float"),
    ("causal_not_bool", _dense_with(causal=_const(None)), TypeError, "causal must be a bool"),
    ("num_splits_negative", _dense_with(num_splits=_const(-1)), ValueError,
     "num_splits must be an int >= 0"),
    ("pack_gqa_str", _dense_with(pack_gqa=_const("yes")), TypeError,
     "pack_gqa must be a bool or None"),
    ("sm_margin_negative", _dense_with(sm_margin=_const(-4)), ValueError,
     "sm_margin must be an int >= 0"),
    ("softcap", _dense_with(softcap=_const(1.0)), NotImplementedError, "^softcap=1.0 is not"),
    ("dropout_p", _dense_with(dropout_p=_const(0.1)), NotImplementedError, "^dropout_p=0.1"),
    ("alibi_slopes", _dense_with(alibi_slopes=_const(torch.rand(4) + 0.1)),
     NotImplementedError, "^alibi_slopes=<tensor> is not supported"),
    ("qv", _dense_with(qv=_const(torch.randn(2, 5, 4, HEAD_DIM))), NotImplementedError, "^qv="),
    ("q_descale", _dense_with(q_descale=_const(torch.ones(2, 2))), NotImplementedError,
     "^q_descale="),
    ("k_descale", _dense_with(k_descale=_const(torch.ones(2, 2))), NotImplementedError,
     "^k_descale="),
    ("v_descale", _dense_with(v_descale=_const(torch.ones(2, 2))), NotImplementedError,
     "^v_descale="),
    ("attention_chunk", _dense_with(attention_chunk=_const(16)), NotImplementedError,
     "^attention_chunk=16"),
    ("varlen_softcap", _varlen_with(softcap=_const(2.0)), NotImplementedError, "^softcap="),
    ("block_table", _varlen_with(block_table=_const(torch.ones(2, 1, dtype=torch.int32))),
     NotImplementedError, "^block_table="),
    ("qkv_not_5d", lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 3, HEAD_DIM)),
     ValueError, r"qkv must be 5-D \(batch, seqlen, 3, heads, head_dim\)"),
    ("qkv_num_heads_q_odd", lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 7, HEAD_DIM),
                                                              num_heads_q=4),
     ValueError, "with num_heads_q=4, qkv must be 4-D"),
    ("kv_wrong_pack", lambda: flash_attn_kvpacked_func(torch.randn(2, 5, 4, HEAD_DIM),
                                                       torch.randn(2, 5, 3, 2, HEAD_DIM)),
     ValueError, r"kv must be 5-D \(batch, seqlen_k, 2, heads_kv, head_dim\)"),
]


@pytest.mark.fast
@pytest.mark.parametrize("call,exc,match", [pytest.param(*case[1:], id=case[0])
                                            for case in BAD_INPUTS])
def test_bad_input_is_rejected(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


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
