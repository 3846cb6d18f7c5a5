"""The ops outside eager Python: torch.export (the training IR keeps torch.ops.flash_cuda.fwd,
whose autograd formula makes the exported step trainable), AOTInductor, and CUDA-graph capture
and replay, dense and varlen."""

import itertools

import pytest
import torch
from test_compile_block import Attention  # projection, GQA flash attention, projection

from flash_cuda import flash_attn_func, flash_attn_varlen_func

HAS_CUDA = torch.cuda.is_available()
cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]
DEVICES = ["cpu", pytest.param("cuda", marks=cuda_only)]


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _cu(lengths, device):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def _inputs(device, varlen):
    torch.manual_seed(0)
    if varlen:
        lengths = [5, 0, 11, 3]
        return (torch.randn(sum(lengths), 64, device=device, dtype=_dtype(device)),
                _cu(lengths, device), max(lengths))
    return (torch.randn(2, 13, 64, device=device, dtype=_dtype(device)),)


def _loss_and_grads(module, inputs):
    module.zero_grad()
    loss = module(*inputs).float().pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.parameters()]


@pytest.mark.fast
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_exported_train_step_matches_eager(device, varlen):
    """torch.export keeps flash_cuda.fwd in the graph; the exported module trains: its loss and
    gradients are eager's."""
    model = Attention(64, 4, 2).to(device, _dtype(device))
    inputs = _inputs(device, varlen)
    exported = torch.export.export(model, inputs)
    assert any("flash_cuda.fwd" in str(n.target) for n in exported.graph.nodes)
    loss, grads = _loss_and_grads(model, inputs)
    exported_module = exported.module()
    loss_e, grads_e = _loss_and_grads(exported_module, inputs)
    torch.testing.assert_close(loss_e, loss, atol=0, rtol=0)
    for a, b in zip(grads_e, grads):
        torch.testing.assert_close(a, b, atol=1e-5 if device == "cpu" else 2e-2, rtol=1e-3)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_aoti_compiled_forward_matches_eager(varlen, tmp_path, toolchain):
    """AOTInductor compiles the exported forward to a package that calls the op through the
    dispatcher (as FlashAttention-3's own export test does). It builds the package with $CXX,
    and a compiler that links its own libstdc++ (Note [One C++ runtime] in csrc/toolchain.py)
    gives a package that crashes when loaded, as it would flash_cuda: build with one that
    passes the toolchain's check."""
    import os
    if not HAS_CUDA:
        pytest.skip("AOTInductor is tested on the GPU (a CPU compile takes minutes)")
    device = "cuda"
    model = Attention(64, 4, 2).to(device, _dtype(device)).eval()
    inputs = _inputs(device, varlen)
    with torch.no_grad(), torch._inductor.config.patch(
            {"cpp.cxx": (None, toolchain.check_cxx_runtime(dict(os.environ), print))}):
        expected = model(*inputs)
        exported = torch.export.export(model, inputs)
        path = torch._inductor.aoti_compile_and_package(
            exported, package_path=str(tmp_path / "attention.pt2"))
        runner = torch._inductor.aoti_load_package(path)
        got = runner(*inputs)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


test_aoti_compiled_forward_matches_eager = pytest.mark.cuda(test_aoti_compiled_forward_matches_eager)


def _graph_case(varlen):
    device = "cuda"
    torch.manual_seed(1)
    if varlen:
        lengths = [7, 0, 300, 1]
        total = sum(lengths)
        q = torch.randn(total, 8, 64, device=device, dtype=torch.bfloat16)
        k = torch.randn(total, 2, 64, device=device, dtype=torch.bfloat16)
        extra = (_cu(lengths, device), _cu(lengths, device), max(lengths), max(lengths))
        fn = flash_attn_varlen_func
    else:
        q = torch.randn(2, 257, 8, 64, device=device, dtype=torch.bfloat16)
        k = torch.randn(2, 257, 2, 64, device=device, dtype=torch.bfloat16)
        extra = ()
        fn = flash_attn_func
    v = torch.randn_like(k)
    return fn, [q, k, v], extra


@pytest.mark.fast
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_cuda_graph_replay_matches_eager(varlen, backward):
    """Captured once, replayed on new values copied into the static inputs: the same results as
    eager calls on those values (the forward is deterministic: equal; gradients within the
    atomics' reordering)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    fn, static, extra = _graph_case(varlen)
    static = [t.requires_grad_(backward) for t in static]
    dout = torch.randn_like(static[0])

    def step():
        out = fn(*static, *extra, causal=True)
        if not backward:
            return [out]
        return [out, *torch.autograd.grad(out, static, dout)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        fresh = [torch.randn_like(t) for t in static]
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        torch.testing.assert_close(captured[0], eager[0], atol=0, rtol=0)
        for got, want in zip(captured[1:], eager[1:]):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


test_cuda_graph_replay_matches_eager = pytest.mark.cuda(test_cuda_graph_replay_matches_eager)
