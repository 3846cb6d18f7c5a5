"""Tests of the op layer as PyTorch sees it: schemas, fake (meta) kernels, opcheck,
torch.compile through the autograd function, and build_info against csrc/manifest.py.

All run on the CPU, where the ops are served by the plain-PyTorch reference.
"""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flash_cuda
from flash_cuda import flash_attn_func, flash_attn_varlen_func

HEAD_DIM = 16
FWD_ARGS = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k",
            "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal", "window_left",
            "window_right", "deterministic"]
BWD_ARGS = ["dout", "q", "k", "v", "out", "softmax_lse", "cu_seqlens_q", "cu_seqlens_k",
            "seqused_q", "seqused_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
            "window_left", "window_right", "deterministic"]


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.fast
def test_schemas():
    fwd = torch.ops.flash_cuda.fwd.default._schema
    bwd = torch.ops.flash_cuda.bwd.default._schema
    assert [a.name for a in fwd.arguments] == FWD_ARGS
    assert [r.name for r in fwd.returns] == ["out", "softmax_lse"]
    assert [a.name for a in bwd.arguments] == BWD_ARGS
    assert [r.name for r in bwd.returns] == ["dq", "dk", "dv"]
    # max_seqlen is a SymInt so that a traced value needs no host sync or specialisation.
    assert "SymInt max_seqlen_q" in str(fwd) and "SymInt max_seqlen_k" in str(bwd)
    # Functional ops: nothing is mutated or aliased.
    assert not fwd.is_mutable and not bwd.is_mutable


def _dense_args(gen, heads=(4, 2), q_len=6, k_len=9, dtype=torch.float32, device="cpu",
                causal=True, window=(-1, -1), seqused=None):
    """Positional fwd arguments of a dense problem."""
    b = 2
    q = _randn(b, q_len, heads[0], HEAD_DIM, gen=gen, dtype=dtype).to(device)
    k = _randn(b, k_len, heads[1], HEAD_DIM, gen=gen, dtype=dtype).to(device)
    v = _randn(b, k_len, heads[1], HEAD_DIM, gen=gen, dtype=dtype).to(device)
    used_q, used_k = seqused or (None, None)
    return (q, k, v, None, None, used_q, used_k, q_len, k_len, HEAD_DIM ** -0.5, causal,
            *window)


def _varlen_args(gen, heads=(4, 2), q_lens=(3, 0, 5, 1), k_lens=(2, 4, 3, 1),
                 dtype=torch.float32, device="cpu", causal=True, window=(-1, -1), seqused=None):
    """Positional fwd arguments of a varlen problem, with one padding row past cu[-1]."""
    q = _randn(sum(q_lens) + 1, heads[0], HEAD_DIM, gen=gen, dtype=dtype).to(device)
    k = _randn(sum(k_lens) + 1, heads[1], HEAD_DIM, gen=gen, dtype=dtype).to(device)
    v = _randn(sum(k_lens) + 1, heads[1], HEAD_DIM, gen=gen, dtype=dtype).to(device)
    used_q, used_k = seqused or (None, None)
    return (q, k, v, _cu(q_lens).to(device), _cu(k_lens).to(device), used_q, used_k,
            max(q_lens), max(k_lens), 0.3, causal, *window)


def _bwd_args(fwd_args, gen, deterministic=False):
    """Positional bwd arguments from the forward's inputs and a real forward on the CPU."""
    q, k, v, *rest = fwd_args
    out, lse = torch.ops.flash_cuda.fwd(*fwd_args)
    dout = _randn(*q.shape, gen=gen, dtype=q.dtype)
    return (dout, q, k, v, out, lse, *rest, deterministic)


@pytest.mark.fast
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_fake_shapes(varlen, device):
    """The fake kernels give the real kernels' shapes, dtypes and contiguity, on any device."""
    gen = torch.Generator().manual_seed(0)
    make = _varlen_args if varlen else _dense_args
    real = make(gen, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        args = tuple(mode.from_tensor(a).to(device) if isinstance(a, torch.Tensor) else a
                     for a in real)
        q, k = args[0], args[1]
        out, lse = torch.ops.flash_cuda.fwd(*args)
        dq, dk, dv = torch.ops.flash_cuda.bwd(out, q, k, args[2], out, lse, *args[3:], False)
    expected_lse = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == expected_lse and lse.dtype == torch.float32
    assert out.device.type == lse.device.type == device
    for grad, like in ((dq, q), (dk, k), (dv, k)):
        assert grad.shape == like.shape and grad.dtype == like.dtype and grad.is_contiguous()


def test_fake_mode_through_the_api():
    """The user API traces under FakeTensorMode: value checks are skipped, nothing is read."""
    with FakeTensorMode():
        q = torch.empty(9, 4, 64, dtype=torch.float16, device="cuda")
        k = torch.empty(7, 2, 64, dtype=torch.float16, device="cuda")
        cu_q = torch.empty(3, dtype=torch.int32, device="cuda")
        cu_k = torch.empty(3, dtype=torch.int32, device="cuda")
        out, lse = flash_attn_varlen_func(q, k, k, cu_q, cu_k, 5, 4, causal=True,
                                          return_attn_probs=True)
        out_dense = flash_attn_func(q[None], k[None], k[None])
    assert out.shape == q.shape and lse.shape == (4, 9)
    assert out_dense.shape == (1, 9, 4, 64)


# (name, args builder) for opcheck; GQA everywhere, masks and seqused vary.
OPCHECK_CASES = {
    "dense_full": lambda g: _dense_args(g, causal=False),
    "dense_causal_local": lambda g: _dense_args(g, window=(3, -1)),
    "dense_seqused": lambda g: _dense_args(g, seqused=(torch.tensor([6, 2], dtype=torch.int32),
                                                       torch.tensor([0, 9], dtype=torch.int32))),
    "varlen_causal": lambda g: _varlen_args(g),
    "varlen_local_seqused": lambda g: _varlen_args(
        g, causal=False, window=(1, 2),
        seqused=(torch.tensor([3, 0, 2, 1], dtype=torch.int32),
                 torch.tensor([1, 4, 3, 0], dtype=torch.int32))),
}


def _requiring_grad(args):
    return tuple(a.detach().clone().requires_grad_()
                 if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(case):
    """Every opcheck test, autograd registration and AOT dispatch (forward + backward through
    the registered formula) included, with inputs that require grad."""
    gen = torch.Generator().manual_seed(1)
    fwd_args = OPCHECK_CASES[case](gen)
    torch.library.opcheck(torch.ops.flash_cuda.fwd.default, _requiring_grad(fwd_args))
    for deterministic in (False, True):
        bwd_args = _bwd_args(fwd_args, gen, deterministic)
        torch.library.opcheck(torch.ops.flash_cuda.bwd.default, bwd_args)
        # bwd has an autograd kernel too (it raises: there is no double backward).
        torch.library.opcheck(torch.ops.flash_cuda.bwd.default, _requiring_grad(bwd_args),
                              test_utils=("test_schema", "test_autograd_registration",
                                          "test_faketensor"))


def test_direct_op_call_is_differentiable():
    """The autograd formula lives on the op: a bare torch.ops call backpropagates, and agrees
    with the Python API."""
    gen = torch.Generator().manual_seed(2)
    fwd_args = _requiring_grad(_varlen_args(gen))
    out, lse = torch.ops.flash_cuda.fwd(*fwd_args)
    assert out.requires_grad and not lse.requires_grad
    dout = _randn(*out.shape, gen=gen)
    grads = torch.autograd.grad(out, fwd_args[:3], dout)
    q, k, v, cu_q, cu_k, _, _, max_q, max_k, scale, causal, left, right = fwd_args
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    api_out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, softmax_scale=scale,
                                     causal=causal, window_size=(left, right))
    api_grads = torch.autograd.grad(api_out, leaves, dout)
    torch.testing.assert_close(out, api_out, atol=0, rtol=0)
    for a, b in zip(grads, api_grads):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_no_double_backward():
    gen = torch.Generator().manual_seed(3)
    fwd_args = _requiring_grad(_dense_args(gen))
    out, _ = torch.ops.flash_cuda.fwd(*fwd_args)
    (dq,) = torch.autograd.grad(out.sum(), fwd_args[0], create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        dq.sum().backward()


def test_cpu_kernel_deterministic_flag():
    gen = torch.Generator().manual_seed(3)
    args = _bwd_args(_varlen_args(gen), gen)
    plain = torch.ops.flash_cuda.bwd(*args[:-1], False)
    deterministic = torch.ops.flash_cuda.bwd(*args[:-1], True)
    for a, b in zip(plain, deterministic):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _dense_step(q, k, v):
    out = flash_attn_func(q, k, v, causal=True, window_size=(5, -1))
    return out * 2.0


def _varlen_step(q, k, v, cu_q, cu_k, max_q, max_k):
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                      return_attn_probs=True)
    return out * lse.transpose(0, 1).clamp(min=0).unsqueeze(-1)


def _forward_backward(fn, tensors, *args):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves, *args)
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    return out.detach(), grads


def _compiled(fn, dynamic):
    # aot_eager runs Dynamo (fullgraph: no graph break) and AOTAutograd over the fake kernels,
    # which is everything these ops add; Inductor would only add CPU code generation for the
    # surrounding elementwise ops, at the cost of a cold C++ compile longer than this suite.
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="aot_eager")


def _assert_same(actual, expected):
    torch.testing.assert_close(actual[0], expected[0], atol=1e-6, rtol=1e-6)
    for a, b in zip(actual[1], expected[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _varlen_inputs(gen, q_lens, k_lens):
    q = _randn(sum(q_lens), 4, HEAD_DIM, gen=gen)
    k = _randn(sum(k_lens), 2, HEAD_DIM, gen=gen)
    v = _randn(sum(k_lens), 2, HEAD_DIM, gen=gen)
    return (q, k, v), (_cu(q_lens), _cu(k_lens), max(q_lens), max(k_lens))


@pytest.mark.fast
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_dense_matches_eager(dynamic):
    gen = torch.Generator().manual_seed(4)
    tensors = (_randn(2, 12, 4, HEAD_DIM, gen=gen), _randn(2, 15, 2, HEAD_DIM, gen=gen),
               _randn(2, 15, 2, HEAD_DIM, gen=gen))
    compiled = _compiled(_dense_step, dynamic)
    _assert_same(_forward_backward(compiled, tensors), _forward_backward(_dense_step, tensors))


@pytest.mark.fast
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_varlen_matches_eager(dynamic):
    """max_seqlen as a Python int: a constant when static, a SymInt under dynamic=True."""
    gen = torch.Generator().manual_seed(5)
    tensors, args = _varlen_inputs(gen, [3, 7, 5], [4, 9, 2])
    compiled = _compiled(_varlen_step, dynamic)
    _assert_same(_forward_backward(compiled, tensors, *args),
                 _forward_backward(_varlen_step, tensors, *args))


def test_compile_dynamic_varlen_does_not_recompile():
    """New lengths, batch and max_seqlen reuse the dynamic graph: max_seqlen stays symbolic."""
    gen = torch.Generator().manual_seed(6)
    compiled = _compiled(_varlen_step, dynamic=True)
    # The first call's sizes (totals 21 / 24, batch + 1 = 5, max 7 / 9, heads 4 / 2, head dim
    # 16) are pairwise distinct, so duck sizing ties none of them together.
    tensors, args = _varlen_inputs(gen, [3, 7, 5, 6], [4, 9, 3, 8])
    _forward_backward(compiled, tensors, *args)
    tensors, args = _varlen_inputs(gen, [6, 2, 9, 4, 5], [5, 11, 3, 8, 6])
    with torch._dynamo.config.patch(error_on_recompile=True):
        actual = _forward_backward(compiled, tensors, *args)
    _assert_same(actual, _forward_backward(_varlen_step, tensors, *args))


BUILD_INFO_KEYS = {"archs", "head_dims", "dtypes", "kernels", "features", "devices"}


@pytest.mark.fast
def test_build_info_matches_manifest(manifest):
    info = flash_cuda.build_info()
    assert BUILD_INFO_KEYS <= set(info)
    assert set(info["head_dims"]) <= set(manifest.DIRECTIONS)
    for direction, dims in info["head_dims"].items():
        assert set(dims) <= set(manifest.HEAD_DIMS), direction
    assert set(info["dtypes"]) <= set(manifest.DTYPES)
    assert all(isinstance(a, int) and a >= 80 for a in info["archs"])
    names = {manifest.Kernel(family, direction, dtype, hdim).name
             for family in manifest.FAMILIES for direction in manifest.DIRECTIONS
             for dtype in manifest.DTYPES for hdim in manifest.HEAD_DIMS}
    assert set(info["kernels"]) <= names
    for direction, dims in info["head_dims"].items():
        from_kernels = {int(n.rsplit("hdim", 1)[1]) for n in info["kernels"]
                        if n.startswith(direction + "_")}
        assert from_kernels == set(dims), direction
    assert all(isinstance(flag, bool) for flag in info["features"].values())
    assert info["features"]["backward"] == bool(info["head_dims"].get("bwd"))
    assert info["devices"][0] == "cpu"
    assert ("cuda" in info["devices"]) == bool(info["kernels"])


def test_build_info_is_a_fresh_plain_dict():
    info = flash_cuda.build_info()
    assert type(info) is dict and type(info["dtypes"]) is list
    info["archs"].append(0)
    assert 0 not in flash_cuda.build_info()["archs"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_build_info_serves_this_gpu():
    """Machine code for this major version at or below this GPU, or PTX of an older arch (the
    newest compiled arch's, which the driver compiles at load: a build for sm80 only on an
    H200)."""
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    archs = flash_cuda.build_info()["archs"]
    assert any(a // 10 == major and a <= cc for a in archs) or max(archs) < cc, archs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_cuda_family_forces_a_family(monkeypatch):
    """FLASH_CUDA_FAMILY, read at every call, picks a compiled family (the kernel that runs is
    that family's: its namespace is in the kernel's name) or says it is not there."""
    from conftest import kernel_families
    info = flash_cuda.build_info()
    dtype = torch.bfloat16 if "bf16" in info["dtypes"] else torch.float16
    q = torch.randn(1, 64, 2, min(info["head_dims"]["fwd"]), device="cuda", dtype=dtype)
    expected = flash_attn_func(q, q, q, causal=True)
    for family in kernel_families():
        monkeypatch.setenv("FLASH_CUDA_FAMILY", family)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = flash_attn_func(q, q, q, causal=True)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "flash_cuda" in e.name]
        assert any(f"flash_cuda::{family}::" in n for n in names), (family, names)
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=0)
    monkeypatch.setenv("FLASH_CUDA_FAMILY", "sm42")
    with pytest.raises(NotImplementedError, match="FLASH_CUDA_FAMILY=sm42 names no kernel family"):
        flash_attn_func(q, q, q)


def test_missing_extension_says_how_to_build():
    # A fresh interpreter, since this one has the extension loaded already.
    code = ("import sys; sys.modules['flash_cuda._C'] = None\n"
            "try:\n    import flash_cuda\nexcept ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1], check=True)
    assert "python setup.py build_ext --inplace" in result.stdout


def _unbacked_max_seqlen_step(q, k, v, cu_q, cu_k):
    # transformers' packed path under torch.compile: max_seqlen from .item(), an unbacked SymInt.
    max_q = cu_q.diff().max().item()
    max_k = cu_k.diff().max().item()
    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True) * 2.0


def test_compile_with_unbacked_max_seqlen():
    gen = torch.Generator().manual_seed(7)
    tensors, (cu_q, cu_k, _, _) = _varlen_inputs(gen, [3, 7, 5], [4, 9, 2])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(_unbacked_max_seqlen_step, fullgraph=True, backend="aot_eager")
        _assert_same(_forward_backward(compiled, tensors, cu_q, cu_k),
                     _forward_backward(_unbacked_max_seqlen_step, tensors, cu_q, cu_k))


def _own_scale_step(q, k, v, scale):
    return flash_attn_func(q, k, v, softmax_scale=scale, causal=True, window_size=[4, 0])


def _shape_scale_step(q, k, v):
    return flash_attn_func(q, k, v, softmax_scale=q.shape[-1] ** -0.5 * 0.5, causal=True)


@pytest.mark.parametrize("fn", [_own_scale_step, _shape_scale_step], ids=["float_arg", "from_shape"])
def test_compile_dynamic_with_own_softmax_scale(fn):
    """dynamic=True makes a float argument (or one computed from a symbolic shape) a SymFloat."""
    gen = torch.Generator().manual_seed(8)
    tensors = (_randn(2, 12, 4, HEAD_DIM, gen=gen), _randn(2, 15, 2, HEAD_DIM, gen=gen),
               _randn(2, 15, 2, HEAD_DIM, gen=gen))
    args = (0.3,) if fn is _own_scale_step else ()
    compiled = _compiled(fn, dynamic=True)
    _assert_same(_forward_backward(compiled, tensors, *args), _forward_backward(fn, tensors, *args))
