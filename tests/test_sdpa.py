"""flash_cuda as PyTorch SDPA's flash-attention implementation (flash_cuda/sdpa.py).

On the CPU: registration, activation and restore in torch's registry, and the wrappers of the
four aten flash ops run on the reference (they are registered for the CPU key too, where those
ops have no kernel of their own), eager and under torch.compile. On a GPU:
F.scaled_dot_product_attention and varlen_attn run flash_cuda's kernels once activated, match
the float32 reference, compile, and go back to torch's own kernels on restore.
"""

import contextlib
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn import attention

import flash_cuda
from flash_cuda import sdpa
from flash_cuda.reference import attention_forward_reference

from conftest import skip_unless_built

HAS_CUDA = torch.cuda.is_available()
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]


@contextlib.contextmanager
def wrappers_on(*keys):
    """The four aten flash ops served by flash_cuda for `keys` (CPU included, for tests)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        handle = sdpa.register(keys)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def activated():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel")
        attention.activate_flash_attention_impl("flash_cuda")
    try:
        yield
    finally:
        attention.restore_flash_attention_impl()


def ran_flash_cuda(fn):
    """Whether fn() called torch.ops.flash_cuda.fwd (seen by the profiler's op events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.name == "flash_cuda::fwd" for e in prof.events())


def _cuda_kernel_source(op):
    dump = torch._C._dispatch_dump(f"aten::{op}")
    return next((line for line in dump.splitlines() if line.startswith("CUDA:")), "")


@pytest.mark.fast
def test_registered_not_active():
    assert "flash_cuda" in attention.list_flash_attention_impls()
    assert attention.current_flash_attention_impl() != "flash_cuda"


@pytest.mark.fast
def test_activate_and_restore():
    if "cuda" not in flash_cuda.build_info()["devices"]:
        with pytest.raises(RuntimeError, match="built without CUDA kernels"):
            attention.activate_flash_attention_impl("flash_cuda")
        assert attention.current_flash_attention_impl() is None
        return
    before = {op: _cuda_kernel_source(op) for op in sdpa._OPS}
    with activated():
        assert attention.current_flash_attention_impl() == "flash_cuda"
        for op in sdpa._OPS:
            assert _cuda_kernel_source(op) != before[op], op
    assert attention.current_flash_attention_impl() is None
    assert {op: _cuda_kernel_source(op) for op in sdpa._OPS} == before
    with activated():  # a second activation after a restore works too
        assert attention.current_flash_attention_impl() == "flash_cuda"
    sdpa.restore()  # nothing active: a no-op


def _bhsd(gen, b, h, s, d, dtype=torch.float32, device="cpu"):
    return torch.randn(b, h, s, d, generator=gen).to(device=device, dtype=dtype)


def _reference_bhsd(q, k, v, causal, scale=None):
    """float32 reference on (b, h, s, d) inputs, bottom-right causal, GQA by head groups."""
    out, lse = attention_forward_reference(*(t.transpose(1, 2).float() for t in (q, k, v)),
                                           softmax_scale=scale, causal=causal)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_sdpa_op_on_the_reference(causal, heads):
    """aten._scaled_dot_product_flash_attention and its backward through the wrappers: out, lse
    and gradients of (b, h, s, d) inputs as the reference gives them."""
    gen = torch.Generator().manual_seed(0)
    q = _bhsd(gen, 2, heads[0], 9, 16).requires_grad_()
    k = _bhsd(gen, 2, heads[1], 9, 16).requires_grad_()
    v = _bhsd(gen, 2, heads[1], 9, 16).requires_grad_()
    with wrappers_on("CPU"):
        assert ran_flash_cuda(lambda: torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, is_causal=causal))
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v,
                                                                          is_causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert out.stride() == torch.empty_like(q).stride() and lse.shape == (2, heads[0], 9)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, _reference_bhsd(q, k, v, causal)[1], atol=1e-5, rtol=1e-5)
    expected_grads = torch.autograd.grad(expected, (q, k, v), torch.ones_like(out))
    for g, e, t in zip(grads, expected_grads, (q, k, v)):
        assert g.stride() == torch.empty_like(t).stride()  # torch's meta kernel's promise
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("window", [(-1, -1), (3, 0), (2, 1)])
def test_flash_attention_forward_varlen_on_the_reference(window):
    """aten._flash_attention_forward (varlen, windows) and its autograd formula."""
    gen = torch.Generator().manual_seed(1)
    lens = [3, 0, 7, 5]
    q = torch.randn(sum(lens), 4, 16, generator=gen).requires_grad_()
    k = torch.randn(sum(lens), 2, 16, generator=gen).requires_grad_()
    v = torch.randn(sum(lens), 2, 16, generator=gen).requires_grad_()
    cu = _cu(lens)
    with wrappers_on("CPU"):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max(lens), max(lens), 0.0, False, False, scale=0.3,
            window_size_left=window[0], window_size_right=window[1])
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    expected, expected_lse = flash_cuda.flash_attn_varlen_func(
        q, k, v, cu, cu, max(lens), max(lens), softmax_scale=0.3, window_size=window,
        return_attn_probs=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), torch.ones_like(out))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_varlen_attn_on_the_reference():
    """torch.nn.attention.varlen.varlen_attn reaches the wrappers through
    aten._flash_attention_forward / _backward."""
    from torch.nn.attention.varlen import varlen_attn
    gen = torch.Generator().manual_seed(2)
    lens = [4, 9, 2]
    q, k, v = (torch.randn(sum(lens), 2, 16, generator=gen).requires_grad_() for _ in range(3))
    cu = _cu(lens)
    with wrappers_on("CPU"):
        out = varlen_attn(q, k, v, cu, cu, max(lens), max(lens), window_size=(-1, 0))
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    expected = flash_cuda.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                                 causal=True)
    expected_grads = torch.autograd.grad(expected, (q, k, v), torch.ones_like(out))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-6)


def test_compile_traces_the_wrappers():
    """Under torch.compile the aten ops keep torch's meta kernels; the wrappers' outputs match
    them (strides included) and run in the compiled graph, forward and backward."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (_bhsd(gen, 1, 2, 6, 16).requires_grad_() for _ in range(3))

    def step(q, k, v):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0]
        return (out * 2).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with wrappers_on("CPU"):
        loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
        expected = step(q, k, v)
        expected_grads = torch.autograd.grad(expected, (q, k, v))
    torch.testing.assert_close(loss, expected)
    for g, e in zip(grads, expected_grads):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("call, match", [
    (lambda q: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, dropout_p=0.1),
     "dropout_p=0.1"),
    (lambda q: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q,
                                                                  return_debug_mask=True),
     "return_debug_mask=True"),
    (lambda q: torch.ops.aten._flash_attention_forward(
        q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None, None, 4, 4, 0.0, False,
        False, alibi_slopes=torch.ones(2)), "alibi_slopes"),
], ids=["dropout", "debug_mask", "alibi"])
def test_unsupported_features_raise(call, match):
    q = torch.randn(1, 2, 4, 16)
    with wrappers_on("CPU"):
        with pytest.raises(NotImplementedError, match=match):
            call(q)


def test_seqused_k_only_in_inference_mode():
    """torch's backward op has no seqused_k: outside inference mode it is refused, even with
    gradients off (a compiled training step runs its forward that way)."""
    q = torch.randn(4, 2, 16, requires_grad=True)
    cu = _cu([4])
    used = torch.tensor([2], dtype=torch.int32)
    with wrappers_on("CPU"):
        for grad_mode in (torch.enable_grad, torch.no_grad):
            with grad_mode(), pytest.raises(NotImplementedError,
                                            match="seqused_k outside torch.inference_mode"):
                torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.0, False,
                                                        False, seqused_k=used)
        with torch.inference_mode():
            out = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.0, False,
                                                          False, seqused_k=used)[0]
    expected = flash_cuda.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, seqused_k=used)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


# ---- on the GPU ------------------------------------------------------------------------------

def _assert_within_rule(ours, ref32, ref_lowp, name):
    """Our error against float32 at most twice torch's flash kernel's, plus 1e-3."""
    assert not torch.isnan(ours).any(), name
    err = (ours.float() - ref32).abs().max().item()
    base = (ref_lowp.float() - ref32).abs().max().item()
    assert err <= 2 * base + 1e-3, f"{name}: {err:.3e} > 2 x {base:.3e} + 1e-3"


def _sdpa_case(dtype, d, heads, causal, seqlen=257):
    gen = torch.Generator().manual_seed(d + seqlen)
    q = _bhsd(gen, 2, heads[0], seqlen, d, dtype, "cuda").requires_grad_()
    k = _bhsd(gen, 2, heads[1], seqlen, d, dtype, "cuda").requires_grad_()
    v = _bhsd(gen, 2, heads[1], seqlen, d, dtype, "cuda").requires_grad_()
    dout = _bhsd(gen, 2, heads[0], seqlen, d, dtype, "cuda")

    def run(fn, inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))

    def sdpa_call(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    with attention.sdpa_kernel(attention.SDPBackend.MATH):
        ref32 = run(sdpa_call, [t.float() for t in (q, k, v)])
    # PyTorch's own low-precision attention: its flash kernel, the one activation replaces.
    with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
        ref_lowp = run(sdpa_call, (q, k, v))
    return q, k, v, run, sdpa_call, ref32, ref_lowp


@pytest.mark.fast
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,heads", [(64, (8, 2)), (128, (4, 4)), (72, (4, 1))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_runs_flash_cuda_on_cuda(dtype, d, heads, causal, compiled):
    skip_unless_built(dtype, d)
    q, k, v, run, sdpa_call, ref32, ref_lowp = _sdpa_case(dtype, d, heads, causal)

    if compiled:
        torch._dynamo.reset()
        inner = torch.compile(sdpa_call, fullgraph=True)
    else:
        inner = sdpa_call

    def fn(q, k, v):
        with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
            return inner(q, k, v)

    def flash(q, k, v):
        with attention.sdpa_kernel(attention.SDPBackend.FLASH_ATTENTION):
            return sdpa_call(q, k, v)

    with activated():
        assert ran_flash_cuda(lambda: fn(q, k, v))
        ours = run(fn, (q, k, v))
    for name, a, r32, rlow in zip(("out", "dq", "dk", "dv"), ours, ref32, ref_lowp):
        _assert_within_rule(a, r32, rlow, name)
    # Restored: torch's own kernel again.
    assert not ran_flash_cuda(lambda: flash(q, k, v))


@pytest.mark.fast
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (64, 0)])
def test_varlen_attn_runs_flash_cuda_on_cuda(window):
    """varlen_attn (empty and odd-length sequences) against the float32 reference."""
    skip_unless_built(torch.bfloat16, 128)
    import test_kernels as kernels
    from torch.nn.attention.varlen import AuxRequest, varlen_attn
    lens = [1, 300, 0, 17, 1000]
    cu = _cu(lens).cuda()
    q, k, v = (kernels.make((sum(lens), 4, 128), torch.bfloat16) for _ in range(3))

    def ours(q_, k_, v_):
        return varlen_attn(q_, k_, v_, cu, cu, 1000, 1000, window_size=window,
                           return_aux=AuxRequest(lse=True))

    with activated():
        assert ran_flash_cuda(lambda: ours(q, k, v))
        kernels.run_and_check(q, k, v, ours, dict(cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  window_left=window[0],
                                                  window_right=window[1]))
