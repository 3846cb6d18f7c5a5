"""torch.compile(fullgraph=True) of a small transformer block built on flash_attn_func and
flash_attn_varlen_func: forward and backward trace with no graph break and match eager.

On CPU the block runs on the reference implementation (aot_eager keeps it quick); on a GPU it
runs the CUDA kernels under the default (inductor) backend.
"""

import pytest
import torch
from torch import nn

from flash_cuda import flash_attn_func, flash_attn_varlen_func


class Attention(nn.Module):
    """A projection into GQA heads, causal flash attention (dense, or varlen given cu_seqlens),
    and the output projection. tests/test_export.py exports it."""

    def __init__(self, dim, heads, heads_kv):
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * heads_kv) * self.head_dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, cu_seqlens=None, max_seqlen=None):
        q, k, v = self.qkv(x).split(
            [self.heads * self.head_dim, self.heads_kv * self.head_dim,
             self.heads_kv * self.head_dim], dim=-1)
        shape = x.shape[:-1]
        q = q.view(*shape, self.heads, self.head_dim)
        k = k.view(*shape, self.heads_kv, self.head_dim)
        v = v.view(*shape, self.heads_kv, self.head_dim)
        if cu_seqlens is None:
            out = flash_attn_func(q, k, v, causal=True)
        else:
            out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                         causal=True)
        return self.proj(out.reshape(*shape, -1))


class Block(nn.Module):
    def __init__(self, dim, heads, heads_kv):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, heads_kv)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attention(self, x, cu_seqlens=None, max_seqlen=None):
        return self.attn(self.norm1(x), cu_seqlens, max_seqlen)

    def forward(self, x, cu_seqlens=None, max_seqlen=None):
        x = x + self.attention(x, cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


def devices():
    params = [pytest.param("cpu", id="cpu")]
    params.append(pytest.param("cuda", id="cuda", marks=[
        pytest.mark.cuda, pytest.mark.fast,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]))
    return params


def run_step(block, x, *args):
    x = x.detach().requires_grad_(True)
    out = block(x, *args)
    out.float().square().mean().backward()
    grads = [p.grad.detach().clone() for p in block.parameters()] + [x.grad]
    block.zero_grad(set_to_none=True)
    return out.detach(), grads


def assert_matches(eager, compiled, tol):
    out_e, grads_e = eager
    out_c, grads_c = compiled
    assert torch.allclose(out_c.float(), out_e.float(), atol=tol, rtol=tol)
    for g_e, g_c in zip(grads_e, grads_c):
        scale = g_e.float().abs().max().clamp_min(1e-6)
        assert ((g_c.float() - g_e.float()).abs().max() / scale).item() < tol


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_block_compiles_fullgraph_and_matches_eager(device, varlen):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dim, heads, heads_kv = (256, 4, 2) if device == "cuda" else (64, 4, 2)
    block = Block(dim, heads, heads_kv).to(device=device, dtype=dtype)
    if varlen:
        lens = torch.tensor([0, 37, 1, 90], dtype=torch.int32)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
        x = torch.randn(int(cu[-1]), dim, device=device, dtype=dtype)
        args = (cu.to(device), int(lens.max()))
    else:
        x = torch.randn(2, 77, dim, device=device, dtype=dtype)
        args = ()
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    eager_result = run_step(block, x, *args)
    compiled_result = run_step(compiled, x, *args)
    assert_matches(eager_result, compiled_result, 3e-2 if dtype == torch.bfloat16 else 1e-4)
