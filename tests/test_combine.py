"""flash_attn_combine and torch.ops.flash_cuda.combine: split-KV partials merged into the
attention over all keys, exact for one split, blind to what a split that saw nothing holds, out=
written in place; the op's rules through the API and through the op; opcheck (the mutation of
out declared) and torch.compile(fullgraph=True); the same results on CUDA."""

import pytest
import torch

import flash_cuda
from flash_cuda import flash_attn_combine
from flash_cuda.reference import attention_forward_reference
from flash_cuda.reference_kvcache import split_partials_reference

B, LQ, LK, HQ, HK, D = 2, 5, 37, 4, 2, 32
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA device")])]


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, n, h, D, generator=g) for n, h in ((LQ, HQ), (LK, HK), (LK, HK)))


def partials(boundaries, causal=False, window=(-1, -1), seed=0):
    q, k, v = qkv(seed)
    out_p, lse_p = split_partials_reference(q, k, v, boundaries, D ** -0.5, causal, window)
    want_out, want_lse = attention_forward_reference(
        q, k, v, softmax_scale=D ** -0.5, causal=causal, window_left=window[0],
        window_right=window[1])
    # The whole attention's lse is (batch, heads, seqlen); combine's is (batch, seqlen, heads).
    return out_p, lse_p, want_out, want_lse.transpose(1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("boundaries, causal, window", [
    ([0, 10, 20, LK], False, (-1, -1)),
    ([0, 0, 17, 17, LK], True, (-1, -1)),     # empty splits
    ([0, 3, 30, 36, LK], True, (4, 0)),       # splits some rows see nothing of
    ([0, LK], False, (-1, -1)),
])
def test_merges_to_the_attention_over_all_keys(device, boundaries, causal, window):
    out_p, lse_p, want_out, want_lse = partials(boundaries, causal, window)
    out, lse = flash_attn_combine(out_p.to(device), lse_p.to(device))
    assert out.dtype == torch.float32 and out.shape == (B, LQ, HQ, D)
    assert lse.shape == (B, LQ, HQ)
    torch.testing.assert_close(out.cpu(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_split_is_exact_and_unseen_rows_are_zero(device, out_dtype):
    """One split's out is its partial rounded once to out's dtype (on CUDA, fp16 / bf16 go
    through the fused combine kernel), its lse the partial's."""
    out_p, lse_p, _, _ = partials([0, LK], causal=True)
    lse_p[0, 1, 2] = float("-inf")  # a row the only split did not see
    out_p[0, 1, 2] = float("nan")
    out, lse = flash_attn_combine(out_p.to(device), lse_p.to(device), out_dtype=out_dtype)
    assert out.dtype == out_dtype
    keep = torch.ones(B, LQ, HQ, dtype=torch.bool)
    keep[1, 2] = False
    torch.testing.assert_close(out.cpu()[keep], out_p[0].to(out_dtype)[keep], atol=0, rtol=0)
    torch.testing.assert_close(lse.cpu()[keep], lse_p[0][keep], atol=0, rtol=0)
    assert (out.cpu()[1, 2] == 0).all() and torch.isneginf(lse.cpu()[1, 2]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_a_split_that_saw_nothing_weighs_nothing(device):
    out_p, lse_p, want_out, want_lse = partials([0, 12, 12, LK])
    out_p[1] = float("nan")  # the empty split: lse -inf, whatever its out holds
    assert torch.isneginf(lse_p[1]).all()
    out, lse = flash_attn_combine(out_p.to(device), lse_p.to(device))
    torch.testing.assert_close(out.cpu(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_out_is_written_in_place_in_its_dtype(device, dtype):
    out_p, lse_p, _, _ = partials([0, 20, LK])
    out_p, lse_p = out_p.to(device), lse_p.to(device)
    out = torch.full((B, LQ, HQ, D), float("nan"), dtype=dtype, device=device)
    got, _ = flash_attn_combine(out_p, lse_p, out=out)
    assert got is out
    # The float32 merge, rounded once: exactly on the CPU; on CUDA the fused kernel sums in
    # another order, so within a rounding of the 16-bit dtype.
    want = flash_attn_combine(out_p, lse_p)[0].to(dtype)
    exact = dict(atol=0, rtol=0) if device == "cpu" else {}
    torch.testing.assert_close(out, want, **exact)
    got, _ = flash_attn_combine(out_p.to(device), lse_p.to(device), out_dtype=dtype)
    assert got.dtype == dtype


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("d", [4, 72, 200, 256, 320])
@pytest.mark.parametrize("splits", [3, 33, 128, 256])
def test_cuda_kernel_over_head_dims_and_split_counts(d, splits):
    """The CUDA combine (fp16 / bf16 out; a head dim over 256 runs PyTorch operations) against
    the float32 merge on the CPU, on random partials with unseen splits (lse -inf, O NaN) and a
    row no split saw, out poisoned with NaN: within one rounding of the dtype."""
    g = torch.Generator().manual_seed(1000 * splits + d)
    b, rows, heads = 2, 3, 5
    out_p = torch.randn(splits, b, rows, heads, d, generator=g)
    lse_p = 3 * torch.randn(splits, b, rows, heads, generator=g)
    unseen = torch.rand(splits, b, rows, heads, generator=g) < 0.2
    lse_p[unseen] = float("-inf")
    out_p[unseen] = float("nan")
    lse_p[:, 1, 2, 4] = float("-inf")
    out_p[:, 1, 2, 4] = float("nan")
    want_out, want_lse = flash_attn_combine(out_p, lse_p)
    for dtype in (torch.float16, torch.bfloat16):
        out = torch.full((b, rows, heads, d), float("nan"), dtype=dtype, device="cuda")
        assert flash_cuda._ops._fusable(out_p.cuda(), out) == (d <= 256)  # the path under test
        got, lse = flash_attn_combine(out_p.cuda(), lse_p.cuda(), out=out)
        torch.testing.assert_close(got.cpu(), want_out.to(dtype))
        torch.testing.assert_close(lse.cpu(), want_lse)
        assert (got.cpu()[1, 2, 4] == 0).all() and torch.isneginf(lse.cpu()[1, 2, 4])


def test_packed_rows():
    """(splits, total_q, heads, d): the varlen layout, rows in any order."""
    out_p, lse_p, want_out, want_lse = partials([0, 9, LK])
    out, lse = flash_attn_combine(out_p.flatten(1, 2), lse_p.flatten(1, 2))
    torch.testing.assert_close(out, want_out.flatten(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse.flatten(0, 1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("change, error, match", [
    ("lse_shape", ValueError, "lse_partial must have out_partial's shape"),
    ("half_partials", ValueError, "out_partial must be float32"),
    ("rank", ValueError, "out_partial must be 5-D"),
    ("no_splits", ValueError, "between 1 and 256 splits"),
    ("out_shape", ValueError, "out must have out_partial's shape without the splits"),
    ("out_int", ValueError, "out must be float32, float16 or bfloat16"),
    ("strided_out", ValueError, "out must have a contiguous last dimension"),
])
@pytest.mark.parametrize("through", ["api", "op"])
def test_rules_name_the_argument(change, error, match, through):
    out_p, lse_p, _, _ = partials([0, 20, LK])
    out = torch.empty(B, LQ, HQ, D)
    if change == "lse_shape":
        lse_p = lse_p[..., :1]
    elif change == "half_partials":
        out_p = out_p.half()
    elif change == "rank":
        out_p, lse_p = out_p[0, 0], lse_p[0, 0]
        out = torch.empty(HQ, D)
    elif change == "no_splits":
        out_p, lse_p = out_p[:0], lse_p[:0]
    elif change == "out_shape":
        out = torch.empty(B, LQ, HQ, D + 1)
    elif change == "out_int":
        out = torch.empty(B, LQ, HQ, D, dtype=torch.int32)
    elif change == "strided_out":
        out = torch.empty(B, LQ, HQ, 2 * D)[..., ::2]
    with pytest.raises(error, match=match):
        if through == "api":
            flash_attn_combine(out_p, lse_p, out=out)
        else:
            torch.ops.flash_cuda.combine(out_p, lse_p, out)


def test_api_rules():
    out_p, lse_p, _, _ = partials([0, 20, LK])
    with pytest.raises(ValueError, match="out_dtype must be"):
        flash_attn_combine(out_p, lse_p, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="out has dtype .* but out_dtype is"):
        flash_attn_combine(out_p, lse_p, out=torch.empty(B, LQ, HQ, D),
                           out_dtype=torch.float16)
    with pytest.raises(TypeError, match="out_partial must be a torch.Tensor"):
        flash_attn_combine([1.0], lse_p)


def test_opcheck_declares_the_mutation_of_out():
    out_p, lse_p, _, _ = partials([0, 20, LK])
    torch.library.opcheck(torch.ops.flash_cuda.combine.default,
                          (out_p, lse_p, torch.empty(B, LQ, HQ, D)))


def test_compiles_fullgraph():
    out_p, lse_p, _, _ = partials([0, 20, LK], causal=True)
    want = flash_attn_combine(out_p, lse_p)
    got = torch.compile(flash_attn_combine, fullgraph=True, backend="aot_eager")(out_p, lse_p)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_exported_from_the_package():
    assert flash_cuda.flash_attn_combine is flash_attn_combine
    assert "flash_attn_combine" in flash_cuda.__all__
