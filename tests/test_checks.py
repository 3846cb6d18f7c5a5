"""Every rejected input raises a Python exception that names the argument and the rule, through
the Python API and through direct torch.ops.flash_cuda calls alike, on the CPU (the reference
kernels, checked in Python) and on CUDA (the kernels, checked in C++ with the same messages:
Note [Checks in two places] in csrc/ops/attention_cuda.cpp). Never a crash.
"""

import itertools

import pytest
import torch

from flash_cuda import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)

from conftest import real_and_fake_errors

HEAD_DIM = 16
HAS_CUDA = torch.cuda.is_available()


def _cu(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _fwd_args(varlen, device):
    """Named arguments of a valid torch.ops.flash_cuda.fwd call (GQA 4 / 2)."""
    gen = torch.Generator().manual_seed(12)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=_dtype(device))

    if varlen:
        q, k, v = randn(5, 4, HEAD_DIM), randn(7, 2, HEAD_DIM), randn(7, 2, HEAD_DIM)
        cu_q, cu_k, max_q, max_k = _cu([2, 3], device), _cu([4, 3], device), 3, 4
    else:
        q, k, v = randn(2, 5, 4, HEAD_DIM), randn(2, 7, 2, HEAD_DIM), randn(2, 7, 2, HEAD_DIM)
        cu_q = cu_k = None
        max_q, max_k = 5, 7
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=None,
                seqused_k=None, max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=0.25,
                causal=False, window_left=-1, window_right=-1)


def _call_api(a):
    window = (a["window_left"], a["window_right"])
    if a["cu_seqlens_q"] is None:
        if a["seqused_q"] is not None or a["seqused_k"] is not None:
            pytest.skip("the dense API has no seqused")
        return flash_attn_func(a["q"], a["k"], a["v"], softmax_scale=a["softmax_scale"],
                               causal=a["causal"], window_size=window)
    return flash_attn_varlen_func(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"],
                                  a["max_seqlen_q"], a["max_seqlen_k"], a["seqused_q"],
                                  a["seqused_k"], softmax_scale=a["softmax_scale"],
                                  causal=a["causal"], window_size=window)


def _call_op(a):
    return torch.ops.flash_cuda.fwd(**a)


def _other_device(device):
    return "cpu" if device == "cuda" else "meta"


def _all_qkv(fn):
    return dict(q=fn, k=fn, v=fn)


def _int_tensor(t, device):
    return torch.randint(1, 5, t.shape, dtype=torch.int32, device=device)


def _head_dim(d):
    return lambda t, device: torch.randn(*t.shape[:-1], d, device=device, dtype=t.dtype)


# (id, varlen, {argument: new value from (old value, device)}, exception, message regex);
# values-only rules (cu_seqlens ordering, max_seqlen covering it, seqused in range) read the
# tensors, which happens only on the CPU (on CUDA it would need a device sync).
OP_CASES = [
    ("dtype_int32", False, _all_qkv(_int_tensor), ValueError, "q has dtype int32"),
    ("dtype_float64", False, _all_qkv(lambda t, d: t.double()), ValueError,
     "q has dtype float64"),
    ("mixed_dtypes", False, dict(k=lambda t, d: t.half()), ValueError,
     "q, k, v must share one dtype.*k float16"),
    ("mixed_devices", False, dict(k=lambda t, d: t.to(_other_device(d))), ValueError,
     "q, k, v must be on the same device.*k on (meta|cpu)"),
    ("q_rank", False, dict(q=lambda t, d: t[0]), ValueError, r"q must be 4-D \(batch, seqlen"),
    ("varlen_q_rank", True, dict(q=lambda t, d: t[None]), ValueError,
     r"q must be 3-D \(total_tokens"),
    ("head_dim_7", False, _all_qkv(_head_dim(7)), ValueError,
     "head dim.*multiple of 8.*got 7"),
    ("head_dim_264", False, _all_qkv(_head_dim(264)), ValueError,
     "head dim.*between 8 and 256.*got 264"),
    ("head_dim_mismatch", False, dict(v=_head_dim(32)), ValueError,
     "q, k and v must share the head dim"),
    ("heads_not_multiple", False,
     dict(q=lambda t, d: torch.randn(2, 5, 3, HEAD_DIM, device=d, dtype=t.dtype)), ValueError,
     r"heads of q \(3\) must be a multiple of the number of heads of k and v \(2\)"),
    ("batch_mismatch", False,
     dict(q=lambda t, d: torch.randn(3, 5, 4, HEAD_DIM, device=d, dtype=t.dtype)), ValueError,
     "same batch size"),
    ("kv_shape_mismatch", False,
     dict(v=lambda t, d: torch.randn(2, 8, 2, HEAD_DIM, device=d, dtype=t.dtype)), ValueError,
     "k and v must have the same shape"),
    ("cu_seqlens_alone", True, dict(cu_seqlens_k=lambda t, d: None), ValueError,
     "cu_seqlens_q and cu_seqlens_k go together"),
    ("cu_seqlens_int64", True, dict(cu_seqlens_q=lambda t, d: t.long()), ValueError,
     "cu_seqlens_q must have dtype int32"),
    ("cu_seqlens_wrong_length", True, dict(cu_seqlens_k=lambda t, d: _cu([4], d)), ValueError,
     "cu_seqlens_k must be 1-D with 3 entries"),
    ("cu_seqlens_2d", True, dict(cu_seqlens_q=lambda t, d: t[None]), ValueError,
     "cu_seqlens_q must be 1-D"),
    ("cu_seqlens_other_device", True, dict(cu_seqlens_q=lambda t, d: t.to(_other_device(d))),
     ValueError, "cu_seqlens_q must be on q's device"),
    ("cu_seqlens_strided", True,
     dict(cu_seqlens_q=lambda t, d: torch.tensor([0, 9, 2, 9, 5], dtype=torch.int32,
                                                 device=d)[::2]),
     ValueError, "cu_seqlens_q must be contiguous"),
    ("seqused_wrong_length", True,
     dict(seqused_k=lambda t, d: torch.ones(3, dtype=torch.int32, device=d)), ValueError,
     "seqused_k must be 1-D with 2 entries"),
    ("seqused_int64", True, dict(seqused_q=lambda t, d: torch.ones(2, dtype=torch.int64,
                                                                   device=d)),
     ValueError, "seqused_q must have dtype int32"),
    ("dense_seqused_wrong_length", False,
     dict(seqused_q=lambda t, d: torch.ones(3, dtype=torch.int32, device=d)), ValueError,
     "seqused_q must be 1-D with 2 entries"),
    ("max_seqlen_negative", True, dict(max_seqlen_q=lambda t, d: -1), ValueError,
     "max_seqlen_q must be >= 0"),
    ("window_minus_2", False, dict(window_left=lambda t, d: -2), ValueError,
     "window_size entries must be >= -1"),
    ("softmax_scale_nan", False, dict(softmax_scale=lambda t, d: float("nan")), ValueError,
     "softmax_scale must be a finite number > 0"),
    ("softmax_scale_inf", False, dict(softmax_scale=lambda t, d: float("inf")), ValueError,
     r"softmax_scale must be a finite number > 0.*got inf"),
    ("softmax_scale_zero", False, dict(softmax_scale=lambda t, d: 0.0), ValueError,
     r"softmax_scale must be a finite number > 0, within \[1e-30, 1e\+30\].*got 0"),
    ("softmax_scale_negative", False, dict(softmax_scale=lambda t, d: -0.5), ValueError,
     "softmax_scale must be a finite number > 0"),
    ("softmax_scale_underflows_float32", False, dict(softmax_scale=lambda t, d: 1e-40),
     ValueError, r"softmax_scale must be a finite number > 0, within \[1e-30, 1e\+30\]"),
    ("softmax_scale_huge", False, dict(softmax_scale=lambda t, d: 1e31), ValueError,
     "softmax_scale must be a finite number > 0"),
]
CPU_ONLY_CASES = [
    ("cu_seqlens_decreasing", True,
     dict(cu_seqlens_q=lambda t, d: torch.tensor([0, 4, 3], dtype=torch.int32)), ValueError,
     r"cu_seqlens_q must be nondecreasing.*cu_seqlens_q\[1\] = 4"),
    ("cu_seqlens_not_from_zero", True,
     dict(cu_seqlens_k=lambda t, d: torch.tensor([1, 4, 7], dtype=torch.int32)), ValueError,
     "cu_seqlens_k must start at 0"),
    ("cu_seqlens_past_total", True,
     dict(cu_seqlens_k=lambda t, d: torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k\[-1\] = 8 exceeds the 7 rows"),
    ("seqused_past_sequence", True,
     dict(seqused_k=lambda t, d: torch.tensor([4, 5], dtype=torch.int32)), ValueError,
     r"seqused_k\[1\] = 5 must lie in \[0, 3\]"),
    ("max_seqlen_too_small", True, dict(max_seqlen_q=lambda t, d: 2), ValueError,
     r"max_seqlen_q = 2 is smaller than the longest sequence in cu_seqlens_q \(3\)"),
]


def _on(device):
    """Marks for a test that runs on `device`."""
    if device == "cpu":
        return ()
    return (pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device"))


def _bad_args(varlen, changes, device):
    args = _fwd_args(varlen, device)
    for name, change in changes.items():
        args[name] = change(args[name], device)
    return args


ALL_CASES = [pytest.param(*case[1:], device, id=f"{case[0]}-{device}", marks=_on(device))
             for case in OP_CASES for device in ("cpu", "cuda")]
ALL_CASES += [pytest.param(*case[1:], "cpu", id=f"{case[0]}-cpu") for case in CPU_ONLY_CASES]


@pytest.mark.fast
@pytest.mark.parametrize("varlen,changes,exc,match,device", ALL_CASES)
def test_op_rule_through_the_op(varlen, changes, exc, match, device):
    with pytest.raises(exc, match=match):
        _call_op(_bad_args(varlen, changes, device))


@pytest.mark.fast
@pytest.mark.parametrize("varlen,changes,exc,match,device", ALL_CASES)
def test_op_rule_through_the_api(varlen, changes, exc, match, device):
    args = _bad_args(varlen, changes, device)
    if args["cu_seqlens_q"] is None and args["cu_seqlens_k"] is not None:
        pytest.skip("the API cannot pass cu_seqlens_k alone")
    if varlen and args["cu_seqlens_k"] is None:
        pytest.skip("the API cannot pass cu_seqlens_q alone")
    with pytest.raises(exc, match=match):
        _call_api(args)


@pytest.mark.fast
@pytest.mark.parametrize("device", [pytest.param(d, marks=_on(d)) for d in ("cpu", "cuda")])
def test_valid_base_call_runs(device):
    """The bad-input cases start from calls that succeed, so each failure is its change's."""
    for varlen in (False, True):
        args = _fwd_args(varlen, device)
        out, lse = _call_op(args)
        assert out.shape == args["q"].shape and not torch.isnan(out).any()
        _call_api(args)


def _bwd_args(device):
    fwd = _fwd_args(False, device)
    out, lse = torch.ops.flash_cuda.fwd(**fwd)
    names = ["q", "k", "v"]
    rest = {n: fwd[n] for n in fwd if n not in names}
    return dict(dout=torch.randn_like(out), **{n: fwd[n] for n in names}, out=out,
                softmax_lse=lse, **rest, deterministic=False)


BWD_CASES = [
    ("dout_shape", dict(dout=lambda t: t[:, :3]), ValueError, "dout must have q's shape"),
    ("out_dtype", dict(out=lambda t: t.double()), ValueError,
     "out must have q's shape .*, dtype .*; got .*float64"),
    ("lse_shape", dict(softmax_lse=lambda t: t[:, :, :4].contiguous()), ValueError,
     r"softmax_lse must be the forward's: float32 of shape \(2, 4, 5\)"),
    ("lse_dtype", dict(softmax_lse=lambda t: t.half()), ValueError,
     "softmax_lse must be the forward's: float32"),
    ("bwd_head_dim", dict(k=lambda t: t[..., :8], v=lambda t: t[..., :8]), ValueError,
     "q, k and v must share the head dim"),
]


@pytest.mark.fast
@pytest.mark.parametrize("device", [pytest.param(d, marks=_on(d)) for d in ("cpu", "cuda")])
@pytest.mark.parametrize("changes,exc,match", [pytest.param(*c[1:], id=c[0]) for c in BWD_CASES])
def test_bwd_rule_through_the_op(changes, exc, match, device):
    args = _bwd_args(device)
    for name, change in changes.items():
        args[name] = change(args[name])
    with pytest.raises(exc, match=match):
        torch.ops.flash_cuda.bwd(**args)


# ---- rules of the Python API only (Python objects, FlashAttention features) ------------------

def _valid_dense():
    args = _fwd_args(False, "cpu")
    return dict(q=args["q"], k=args["k"], v=args["v"])


def _valid_varlen():
    a = _fwd_args(True, "cpu")
    return dict(q=a["q"], k=a["k"], v=a["v"], cu_seqlens_q=a["cu_seqlens_q"],
                cu_seqlens_k=a["cu_seqlens_k"], max_seqlen_q=3, max_seqlen_k=4)


def _dense_with(**changes):
    kw = _valid_dense()
    kw.update(changes)
    return lambda: flash_attn_func(**kw)


def _varlen_with(**changes):
    kw = _valid_varlen()
    kw.update(changes)
    return lambda: flash_attn_varlen_func(**kw)


API_CASES = [
    ("q_not_tensor", lambda: flash_attn_func([1.0], *list(_valid_dense().values())[1:]),
     TypeError, "q must be a torch.Tensor"),
    ("v_not_tensor", _dense_with(v=None), TypeError, "v must be a torch.Tensor"),
    ("cu_seqlens_not_tensor", _varlen_with(cu_seqlens_q=[0, 2, 5]), TypeError,
     "cu_seqlens_q must be a torch.Tensor"),
    ("seqused_not_tensor", _varlen_with(seqused_k=[1, 2]), TypeError,
     "seqused_k must be a torch.Tensor or None"),
    ("max_seqlen_float", _varlen_with(max_seqlen_k=4.0), TypeError,
     "max_seqlen_k must be an int"),
    ("max_seqlen_float_tensor", _varlen_with(max_seqlen_q=torch.tensor(3.0)), TypeError,
     "max_seqlen_q must be an int"),
    ("max_seqlen_none", _varlen_with(max_seqlen_q=None), TypeError,
     "max_seqlen_q must be an int"),
    ("window_not_pair", _dense_with(window_size=(3,)), TypeError, "window_size must be a pair"),
    ("window_three_tensor", _dense_with(window_size=torch.tensor([1, 2, 3])), TypeError,
     "window_size must be a pair"),
    ("window_float", _dense_with(window_size=(3.0, 0)), TypeError,
     "window_size entries must be ints"),
    ("window_minus_2", _dense_with(window_size=(-2, 0)), ValueError,
     "window_size entries must be >= -1"),
    ("softmax_scale_tensor", _dense_with(softmax_scale=torch.tensor(0.5)), TypeError,
     "softmax_scale must be a float"),
    ("softmax_scale_str", _dense_with(softmax_scale="0.5"), TypeError,
     "softmax_scale must be a float"),
    ("causal_not_bool", _dense_with(causal=None), TypeError, "causal must be a bool"),
    ("causal_int", _dense_with(causal=1), TypeError, "causal must be a bool"),
    ("deterministic_str", _dense_with(deterministic="yes"), TypeError,
     "deterministic must be a bool"),
    ("return_attn_probs_none", _dense_with(return_attn_probs=None), TypeError,
     "return_attn_probs must be a bool"),
    ("num_splits_negative", _dense_with(num_splits=-1), ValueError,
     "num_splits must be an int >= 0"),
    ("pack_gqa_str", _dense_with(pack_gqa="yes"), TypeError, "pack_gqa must be a bool or None"),
    ("sm_margin_negative", _dense_with(sm_margin=-4), ValueError,
     "sm_margin must be an int >= 0"),
    ("softcap", _dense_with(softcap=1.0), NotImplementedError, "^softcap=1.0 is not"),
    ("dropout_p", _dense_with(dropout_p=0.1), NotImplementedError, "^dropout_p=0.1"),
    ("alibi_slopes", _dense_with(alibi_slopes=torch.rand(4) + 0.1), NotImplementedError,
     "^alibi_slopes=<tensor> is not supported"),
    ("qv", _dense_with(qv=torch.randn(2, 5, 4, HEAD_DIM)), NotImplementedError, "^qv="),
    ("q_descale", _dense_with(q_descale=torch.ones(2, 2)), NotImplementedError, "^q_descale="),
    ("k_descale", _dense_with(k_descale=torch.ones(2, 2)), NotImplementedError, "^k_descale="),
    ("v_descale", _dense_with(v_descale=torch.ones(2, 2)), NotImplementedError, "^v_descale="),
    ("attention_chunk", _dense_with(attention_chunk=16), NotImplementedError,
     "^attention_chunk=16"),
    ("s_aux", _dense_with(s_aux=torch.zeros(4)), NotImplementedError, "^s_aux=<tensor>"),
    ("learnable_sink", _dense_with(learnable_sink=torch.zeros(4)), NotImplementedError,
     "^learnable_sink=<tensor>"),
    ("varlen_s_aux", _varlen_with(s_aux=torch.zeros(4)), NotImplementedError, "^s_aux="),
    ("varlen_softcap", _varlen_with(softcap=2.0), NotImplementedError, "^softcap="),
    ("block_table_with_cu_seqlens_k",
     _varlen_with(block_table=torch.ones(2, 1, dtype=torch.int32)), ValueError,
     "pass cu_seqlens_k=None"),
    ("varlen_out", _varlen_with(out=torch.empty(5, 4, HEAD_DIM)), NotImplementedError,
     "out= is supported in the inference call shape only"),
    ("qkv_not_5d", lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 3, HEAD_DIM)),
     ValueError, r"qkv must be 5-D \(batch, seqlen, 3, heads, head_dim\)"),
    ("qkv_num_heads_q_odd", lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 7, HEAD_DIM),
                                                              num_heads_q=4),
     ValueError, "with num_heads_q=4, qkv must be 4-D"),
    ("qkv_num_heads_q_float", lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 8, HEAD_DIM),
                                                                num_heads_q=4.0),
     TypeError, "num_heads_q must be an int"),
    ("kv_wrong_pack", lambda: flash_attn_kvpacked_func(torch.randn(2, 5, 4, HEAD_DIM),
                                                       torch.randn(2, 5, 3, 2, HEAD_DIM)),
     ValueError, r"kv must be 5-D \(batch, seqlen_k, 2, heads_kv, head_dim\)"),
]


@pytest.mark.fast
@pytest.mark.parametrize("call,exc,match", [pytest.param(*case[1:], id=case[0])
                                            for case in API_CASES])
def test_api_rule(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_cuda_kernel_is_registered():
    """A CUDA kernel is always registered: the compiled one, or, in a build without CUDA
    kernels, one that says so (called here through the dispatcher's CUDA entry, no GPU
    needed)."""
    import flash_cuda
    kernel = torch.library.get_kernel("flash_cuda::fwd", "CUDA")
    if "cuda" in flash_cuda.build_info()["devices"]:
        return
    q = torch.randn(1, 4, 2, HEAD_DIM, dtype=torch.float16)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(NotImplementedError, match="built without CUDA kernels"):
        kernel.call_boxed(keys, q, q, q, None, None, None, None, 4, 4, 0.25, False, -1, -1,
                          False)




@pytest.mark.fast
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("varlen,changes", [pytest.param(c[1], c[2], id=c[0]) for c in OP_CASES])
def test_cuda_and_fake_kernels_say_the_same(varlen, changes):
    """Word for word: the C++ checks of the CUDA kernel and the Python checks of the fake kernel
    (what torch.compile meets) on the same CUDA inputs (Note [Checks in two places])."""
    args = _bad_args(varlen, changes, "cuda")
    real, fake = real_and_fake_errors(torch.ops.flash_cuda.fwd, args)
    assert real is not None and real == fake


@pytest.mark.fast
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("changes", [pytest.param(c[1], id=c[0]) for c in BWD_CASES])
def test_cuda_and_fake_bwd_kernels_say_the_same(changes):
    args = _bwd_args("cuda")
    for name, change in changes.items():
        args[name] = change(args[name])
    real, fake = real_and_fake_errors(torch.ops.flash_cuda.bwd, args)
    assert real is not None and real == fake


@pytest.mark.fast
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cpu_q_with_a_cuda_index_tensor_names_it():
    """A CUDA cu_seqlens sends a CPU call to the CUDA kernel; its rule is still q's device's."""
    args = _fwd_args(True, "cpu")
    args["cu_seqlens_q"] = args["cu_seqlens_q"].cuda()
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be on q's device \(cpu\)"):
        _call_op(args)
