"""GPU correctness of every kernel family the GPU runs (the `kernel_family` fixture of
conftest.py: the portable sm80 family, and the Hopper sm90 forward on an H100 / H200, whose
backward falls back to sm80) against the float32 reference.

Rule (FlashAttention's): for out, lse, dq, dk, dv our max error against the float32 reference is
at most twice the error of the same reference computed in the input dtype, plus an absolute
term for float32 rounding noise and half an ulp of the output dtype at the reference's largest
magnitude (`half_ulp`).  Inputs are fresh random tensors; outputs land in memory that
was poisoned with NaN first, so an element the kernels never write fails the test.
"""

import math

import pytest
import torch

from flash_cuda.reference import attention_backward_reference, attention_forward_reference

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("kernel_family"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

def build_info():
    if not torch.cuda.is_available():
        return {"head_dims": {"fwd": [64]}, "dtypes": ["bf16", "fp16"]}
    import flash_cuda
    return flash_cuda.build_info()


def has_backward(d):
    """Whether this build has a backward kernel for head dim d (a forward-only build,
    FLASH_CUDA_DISABLE_BACKWARD=1, has none: its tests check the forward alone)."""
    return any(h >= d for h in build_info()["head_dims"].get("bwd", []))


def compiled_head_dims():
    return sorted(build_info()["head_dims"]["fwd"])


DTYPES = [dt for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16))
          if name in build_info()["dtypes"]]


# Every compiled head dim plus ones that run on the next size up (where the build has one: a
# FLASH_CUDA_HDIMS subset may stop below 136).
HEAD_DIMS = sorted(set(compiled_head_dims())
                   | {d for d in (8, 72, 136) if d <= compiled_head_dims()[-1]})
# The smallest and largest compiled tiles (the largest, 256, splits rows between warp pairs).
FAST_HEAD_DIMS = sorted({compiled_head_dims()[0], compiled_head_dims()[-1]}
                        | ({72} if compiled_head_dims()[-1] >= 72 else set()))


def poison_allocator():
    """Fills the caching allocator's free memory with NaN so unwritten outputs show up. The
    16-bit pattern 0x7FFF is a NaN in bfloat16 and float16, and two of them a float32 NaN; a
    float32 NaN (0x7FC00000) would leave every other 16-bit element reading 0."""
    junk = torch.full((128 << 20,), 0x7FFF, device="cuda", dtype=torch.int16)
    del junk


def max_err(a, b):
    a, b = a.float(), b.float()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    diff = (a - b).abs().masked_fill(both_inf, 0)
    return diff.nan_to_num(nan=float("inf")).max().item() if diff.numel() else 0.0


def half_ulp(t, ref):
    """Half a unit in the last place of t's dtype at ref's largest magnitude: what storing the
    exact result in that dtype may cost at the largest element.  The low-precision reference's
    worst element can by chance round closer than that, on small problems (a head-dim-8 dq of
    17 x 17 failed 2 x base by one bf16 ulp, 0.031 at a magnitude of 4-8, about once in 1000
    runs)."""
    m = ref.float().abs().nan_to_num(posinf=0.0).max().item() if ref.numel() else 0.0
    if m == 0.0 or not t.dtype.is_floating_point:
        return 0.0
    return 0.5 * torch.finfo(t.dtype).eps * 2.0 ** math.floor(math.log2(m))


def assert_close(name, ours, ref, ref_lowp, atol):
    assert not torch.isnan(ours).any(), f"{name} holds NaN (unwritten or bad arithmetic)"
    err, base = max_err(ours, ref), max_err(ref_lowp, ref)
    tol = 2 * base + atol + half_ulp(ours, ref)
    assert err <= tol, f"{name}: error {err:.3e} > 2 x {base:.3e} + {atol:.1e} + half an ulp"


def make(shape, dtype, requires_grad=False):
    return torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(requires_grad)


def run_and_check(q, k, v, fn_ours, ref_kwargs, check_grad=True):
    """fn_ours(q, k, v) -> (out, lse); compares out, lse and (optionally) the gradients."""
    poison_allocator()
    q_, k_, v_ = (t.detach().requires_grad_(check_grad) for t in (q, k, v))
    out, lse = fn_ours(q_, k_, v_)
    ref = attention_forward_reference(q, k, v, **ref_kwargs)
    ref_lp = attention_forward_reference(q, k, v, upcast=False, **ref_kwargs)
    assert_close("out", out, ref[0], ref_lp[0], 1e-3)
    assert_close("lse", lse, ref[1], ref_lp[1], 1e-3)
    # A forward-only build (FLASH_CUDA_DISABLE_BACKWARD=1) still checks the forward.
    if not check_grad or not has_backward(q.shape[-1]):
        return
    dout = torch.randn_like(out)
    poison_allocator()
    dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), dout)
    grads = attention_backward_reference(dout, q, k, v, ref[0], ref[1], **ref_kwargs)
    grads_lp = attention_backward_reference(dout, q, k, v, ref_lp[0], ref_lp[1], upcast=False,
                                            **ref_kwargs)
    for name, ours, r, r_lp in zip(("dq", "dk", "dv"), (dq, dk, dv), grads, grads_lp):
        assert_close(name, ours, r, r_lp, 2e-3)


def dense_case(dtype, d, seqlen_q, seqlen_k, heads, heads_kv, window, causal, batch=2):
    from flash_cuda import flash_attn_func
    q = make((batch, seqlen_q, heads, d), dtype)
    k = make((batch, seqlen_k, heads_kv, d), dtype)
    v = make((batch, seqlen_k, heads_kv, d), dtype)
    scale = 1.0 / math.sqrt(d)

    def ours(q_, k_, v_):
        return flash_attn_func(q_, k_, v_, softmax_scale=scale, causal=causal,
                               window_size=window, return_attn_probs=True)

    ref_kwargs = dict(softmax_scale=scale, causal=causal, window_left=window[0],
                      window_right=window[1])
    run_and_check(q, k, v, ours, ref_kwargs)


MASKS = [((-1, -1), False), ((-1, -1), True), ((64, 0), False), ((17, 5), False),
         ((0, 0), False), ((-1, 3), True)]


@pytest.mark.fast
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", FAST_HEAD_DIMS)
@pytest.mark.parametrize("window,causal", MASKS[:3])
@pytest.mark.parametrize("seqlens", [(1, 1), (113, 203), (256, 128)])
def test_dense_fast(dtype, d, window, causal, seqlens):
    dense_case(dtype, d, seqlens[0], seqlens[1], 4, 2, window, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("window,causal", MASKS)
@pytest.mark.parametrize("seqlens", [(1, 1), (17, 17), (113, 203), (1000, 512), (512, 1000)])
def test_dense(dtype, d, window, causal, seqlens):
    dense_case(dtype, d, seqlens[0], seqlens[1], 2, 2, window, causal)


@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seqlens", [(2048, 2048), (17, 2100)])
def test_gqa_long(ratio, causal, seqlens):
    dense_case(DTYPES[0], 128 if 128 in compiled_head_dims() else compiled_head_dims()[0],
               seqlens[0], seqlens[1], 8, 8 // ratio, (-1, -1), causal, batch=1)


@pytest.mark.parametrize("d", FAST_HEAD_DIMS)
@pytest.mark.parametrize("window,causal", [((-1, -1), True), ((64, 0), False), ((-1, 3), True)])
def test_dense_wide_head_groups(d, window, causal):
    """Under a mask the persistent forward orders the tiles of up to 32 heads together (Note
    [Block order]): 8 heads (GQA 4:1) in one group, 4 sequences of 777 rows, more tiles than an
    H200 has SMs, so that blocks draw the tiles of a wide group from the counter."""
    dense_case(DTYPES[0], d, 777, 777, 8, 2, window, causal, batch=4)


@pytest.mark.parametrize("d", FAST_HEAD_DIMS)
@pytest.mark.parametrize("heads", [(12, 4), (7, 7), (5, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_odd_grid(d, heads, causal):
    """Query tiles, heads and GQA ratios that are no powers of two, over 5 sequences: the
    persistent forward divides a tile index into (query tile, head, batch) and a head by the
    GQA ratio with multipliers the launcher precomputes (kFastDivide in sm90/tile_config.h)."""
    dense_case(DTYPES[0], d, 333, 421, heads[0], heads[1], (-1, -1), causal, batch=5)


@pytest.mark.parametrize("d", FAST_HEAD_DIMS)
@pytest.mark.parametrize("window,causal", [((-1, -1), True), ((40, 0), False), ((-1, 5), True),
                                           ((-1, -1), False)])
def test_tiles_end_at_last_row(d, window, causal):
    """Query lengths around a tile of 128 and 192 rows, queries fewer and more than keys, packed
    sequences of 1 and 0 rows behind longer ones, and many tiles per block, under masks with and
    without a right bound.  With kAlignLastTile (sm90/tile_config.h) the sm90 forward ends a
    sequence's query tiles within 64 rows of its last row, so that its first tile starts before
    row 0: the warp groups there compute and store nothing, and the others read their Q 64 or
    128 rows down in the tile's buffer."""
    for seqlen_q, seqlen_k in [(1, 1), (65, 65), (191, 230), (193, 193), (500, 421)]:
        dense_case(DTYPES[0], d, seqlen_q, seqlen_k, 4, 2, window, causal, batch=3)
    # Several tiles per block, many of them first tiles with a warp group before the sequence
    # (the warp groups' turns must stay in step across tiles).
    dense_case(DTYPES[0], d, 320, 320, 4, 4, window, causal, batch=48)
    varlen_case(DTYPES[0], d, [191, 1, 0, 385, 64, 250], [191, 7, 3, 385, 64, 300], 4, 2,
                window, causal)


@pytest.mark.parametrize("heads", [(8, 1), (8, 2), (32, 8)])
@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((-1, -1), True), ((-1, 3), False),
                                           ((100, 0), False)])
@pytest.mark.parametrize("seqlen_k", [1, 17, 1000, 4097])
def test_gqa_decode(heads, window, causal, seqlen_k):
    """One query row per sequence: the launchers pack a GQA group into one tile (a left window
    shorter than the keys keeps it unpacked)."""
    dense_case(DTYPES[0], FAST_HEAD_DIMS[-1], 1, seqlen_k, heads[0], heads[1], window, causal,
               batch=3)


def test_gqa_decode_with_seqused_q():
    """seqused_q caps query rows, so a dense q with it is not packed (through the op)."""
    d = FAST_HEAD_DIMS[-1]
    q, k, v = make((3, 1, 8, d), DTYPES[0]), make((3, 40, 2, d), DTYPES[0]), make((3, 40, 2, d),
                                                                              DTYPES[0])
    used = torch.tensor([1, 0, 1], dtype=torch.int32, device="cuda")

    def ours(q_, k_, v_):
        return torch.ops.flash_cuda.fwd(q_, k_, v_, None, None, used, None, 1, 40, d ** -0.5,
                                        True, -1, 0)

    run_and_check(q, k, v, ours, dict(seqused_q=used, softmax_scale=d ** -0.5, causal=True))


@pytest.mark.parametrize("d", FAST_HEAD_DIMS)
def test_dense_seqused_query_tiles_past_the_rows(d):
    """Dense q with seqused_q and seqused_k, no mask, 3 query tiles per head: tiles whose rows
    all lie past seqused_q (0, 5, 129 rows used) beside tiles that are full, and a batch whose
    rows see no key (seqused_k 0): out 0 and lse -inf there and past the used rows."""
    dtype = DTYPES[0]
    q = make((4, 384, 4, d), dtype)
    k, v = (make((4, 333, 2, d), dtype) for _ in range(2))
    used_q = torch.tensor([300, 0, 129, 5], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([333, 17, 0, 200], dtype=torch.int32, device="cuda")

    def ours(q_, k_, v_):
        return torch.ops.flash_cuda.fwd(q_, k_, v_, None, None, used_q, used_k, 384, 333,
                                        d ** -0.5, False, -1, -1)

    run_and_check(q, k, v, ours, dict(seqused_q=used_q, seqused_k=used_k,
                                      softmax_scale=d ** -0.5), check_grad=False)


def varlen_case(dtype, d, lens_q, lens_k, heads, heads_kv, window, causal, seqused=None):
    from flash_cuda import flash_attn_varlen_func
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32,
                        device="cuda")
    q = make((int(cu_q[-1]) + 3, heads, d), dtype)  # 3 trailing rows outside every sequence
    k = make((int(cu_k[-1]), heads_kv, d), dtype)
    v = make((int(cu_k[-1]), heads_kv, d), dtype)
    used_q = used_k = None
    if seqused is not None:
        used_q = torch.tensor([min(s, l) for s, l in zip(seqused, lens_q)], dtype=torch.int32,
                              device="cuda")
        used_k = torch.tensor([min(s, l) for s, l in zip(seqused, lens_k)], dtype=torch.int32,
                              device="cuda")

    def ours(q_, k_, v_):
        return flash_attn_varlen_func(q_, k_, v_, cu_q, cu_k, max(lens_q), max(lens_k),
                                      seqused_q=used_q, seqused_k=used_k, causal=causal,
                                      window_size=window, return_attn_probs=True)

    ref_kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=used_q, seqused_k=used_k,
                      causal=causal, window_left=window[0], window_right=window[1])
    run_and_check(q, k, v, ours, ref_kwargs)


VARLEN_BATCHES = [([0, 1, 17, 300, 0, 129], [5, 0, 17, 200, 3, 129]),
                  ([1000, 1, 2], [1000, 2048, 1])]


@pytest.mark.fast
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,causal", MASKS[:3])
def test_varlen_fast(dtype, window, causal):
    lens_q, lens_k = VARLEN_BATCHES[0]
    varlen_case(dtype, FAST_HEAD_DIMS[0], lens_q, lens_k, 4, 1, window, causal)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("window,causal", MASKS)
@pytest.mark.parametrize("batch", VARLEN_BATCHES)
def test_varlen(d, window, causal, batch):
    varlen_case(DTYPES[0], d, batch[0], batch[1], 4, 2, window, causal)


# 36 sequences, 114 query tiles of 128 rows per head: more tiles than an H200 has SMs, so a
# persistent block takes several in turn, with sequences that have no rows or no keys between
# the others.
MANY_TILES_BATCH = ([300, 0, 129, 1000, 17, 640] * 6, [200, 5, 0, 1000, 300, 640] * 6)


@pytest.mark.fast
@pytest.mark.parametrize("d", FAST_HEAD_DIMS)
@pytest.mark.parametrize("window,causal", MASKS[:4])
def test_blocks_take_many_tiles(d, window, causal):
    """A persistent block frees Q's buffer before its last P V and loads the next tile's first K
    before its Q: every tile of a long schedule must still be right."""
    lens_q, lens_k = MANY_TILES_BATCH
    varlen_case(DTYPES[0], d, lens_q, lens_k, 8, 2, window, causal)


@pytest.mark.skipif(128 not in compiled_head_dims(), reason="no head-dim-128 kernel built")
@pytest.mark.parametrize("window,causal", [((-1, -1), False), ((-1, -1), True), ((300, 0), False)])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_long_keys(window, causal, varlen):
    """Long key sequences at head dim 128, with a partial last key tile for 128- and 176-key tiles
    (8300 = 64 x 128 + 108 = 47 x 176 + 28; a 176-key tile was timed for long keys, NOTES 56)."""
    if varlen:
        varlen_case(DTYPES[0], 128, [300, 0, 129], [8300, 17, 9001], 4, 2, window, causal)
    else:
        dense_case(DTYPES[-1], 128, 300, 8300, 4, 2, window, causal, batch=1)


@pytest.mark.fast
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused(causal):
    lens_q, lens_k = VARLEN_BATCHES[0]
    varlen_case(DTYPES[-1], FAST_HEAD_DIMS[0], lens_q, lens_k, 2, 2, (-1, -1), causal,
                seqused=[0, 1, 9, 250, 0, 64])


@pytest.mark.fast
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", FAST_HEAD_DIMS)
@pytest.mark.parametrize("scale", [0.3, 2.0])
@pytest.mark.parametrize("causal", [False, True])
def test_row_maximum_growing_across_key_tiles(dtype, d, scale, causal):
    # Keys grow in magnitude towards the front, which the forward visits last, so the running
    # maxima rise tile after tile.  At 0.3 they stay within 8 log2 units of the first tile's
    # (the stale maximum is kept throughout, Note [Stale row maximum]); at 2.0 they end about
    # 30 units above it, so the maximum must be raised and O rescaled, or P overflows fp16.
    from flash_cuda import flash_attn_func
    seqlen = 700
    q = make((1, seqlen, 2, d), dtype)
    ramp = torch.linspace(3.0, 0.2, seqlen, device="cuda").view(1, seqlen, 1, 1)
    k = (make((1, seqlen, 2, d), torch.float32) * ramp).to(dtype)
    v = make((1, seqlen, 2, d), dtype)

    def ours(q_, k_, v_):
        return flash_attn_func(q_, k_, v_, softmax_scale=scale / math.sqrt(d), causal=causal,
                               return_attn_probs=True)

    run_and_check(q, k, v, ours, dict(softmax_scale=scale / math.sqrt(d), causal=causal))


@pytest.mark.fast
def test_strided_inputs_read_in_place():
    """Only the last dim must be contiguous: a packed qkv buffer is read through views."""
    from flash_cuda import flash_attn_func, flash_attn_qkvpacked_func
    d = FAST_HEAD_DIMS[0]
    qkv = make((2, 300, 3, 4, d), DTYPES[0])
    q, k, v = qkv.unbind(2)
    assert q.stride(-1) == 1 and not q.is_contiguous()
    out = flash_attn_func(q, k, v, causal=True)
    ref = flash_attn_func(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(out, ref)
    assert torch.equal(flash_attn_qkvpacked_func(qkv, causal=True), ref)


@pytest.mark.fast
def test_misaligned_strides_still_correct():
    from flash_cuda import flash_attn_func
    d = FAST_HEAD_DIMS[0]
    base = make((2, 100, 4, d + 4), DTYPES[0])
    q = base[..., 4:]  # rows start 8 bytes in: not 16-byte aligned
    k, v = make((2, 100, 4, d), DTYPES[0]), make((2, 100, 4, d), DTYPES[0])
    out = flash_attn_func(q, k, v)
    ref = flash_attn_func(q.contiguous(), k, v)
    assert torch.equal(out, ref)


@pytest.mark.fast
def test_no_visible_key_gives_zero_and_no_nan():
    from flash_cuda import flash_attn_func
    d = FAST_HEAD_DIMS[0]
    q, k, v = (make((1, n, 2, d), DTYPES[0], True) for n in (64, 16, 16))
    out, lse = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    # bottom-right causal: the first 48 query rows see no key
    assert (out[:, :48] == 0).all() and torch.isinf(lse[..., :48]).all()
    if not has_backward(d):
        return
    out.sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()
    assert (q.grad[:, :48] == 0).all()


@pytest.mark.parametrize("varlen", [False, True])
def test_no_keys_at_all(varlen, capfd):
    """Empty K and V (a null data pointer): out 0 and lse -inf, and nothing on stderr (no TMA
    descriptor is built on a null address)."""
    from flash_cuda import flash_attn_func, flash_attn_varlen_func
    d = FAST_HEAD_DIMS[0]
    poison_allocator()
    if varlen:
        q = make((37, 4, d), DTYPES[0])
        k = v = make((0, 2, d), DTYPES[0])
        cu_q = torch.tensor([0, 30, 37], dtype=torch.int32, device="cuda")
        cu_k = torch.zeros(3, dtype=torch.int32, device="cuda")
        out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 0, return_attn_probs=True)
    else:
        q = make((2, 37, 4, d), DTYPES[0])
        k = v = make((2, 0, 2, d), DTYPES[0])
        out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    torch.cuda.synchronize()
    assert (out == 0).all() and (lse == -math.inf).all()
    assert capfd.readouterr().err == ""


def test_large_tensor_64bit_offsets():
    """More than 2^31 elements in k/v: offsets must not wrap."""
    from flash_cuda import flash_attn_func
    free, _ = torch.cuda.mem_get_info()
    if free < 24 << 30:
        pytest.skip("needs 24 GiB of free GPU memory")
    d = FAST_HEAD_DIMS[0]
    seqlen_k = (2**31) // (8 * d) + 4096
    k = torch.randn((1, seqlen_k, 8, d), device="cuda", dtype=DTYPES[0])
    v = torch.randn_like(k)
    q = make((1, 64, 8, d), DTYPES[0])
    out = flash_attn_func(q, k, v, window_size=(0, 200), causal=False)
    # only the last ~264 keys are visible to the 64 rows: compare on that slice
    tail = seqlen_k - 64 - 256
    ref = attention_forward_reference(q, k[:, tail:], v[:, tail:], window_left=0,
                                      window_right=200)[0]
    assert (out.float() - ref.float()).abs().max().item() < 2e-2


@pytest.mark.fast
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_opcheck_cuda(varlen):
    """Schema, fake kernel and dispatch of the CUDA implementations agree (torch.library)."""
    d, dtype = FAST_HEAD_DIMS[0], DTYPES[0]
    if varlen:
        cu = torch.tensor([0, 5, 5, 70], dtype=torch.int32, device="cuda")
        q, k, v = (make((70, 4, d), dtype) for _ in range(3))
        fwd_args = (q, k, v, cu, cu, None, None, 65, 65, d ** -0.5, True, -1, -1)
    else:
        q, k, v = make((2, 33, 4, d), dtype), make((2, 40, 2, d), dtype), make((2, 40, 2, d), dtype)
        fwd_args = (q, k, v, None, None, None, None, 33, 40, d ** -0.5, False, 8, 3)
    torch.library.opcheck(torch.ops.flash_cuda.fwd.default, fwd_args)
    if not has_backward(d):
        return
    out, lse = torch.ops.flash_cuda.fwd(*fwd_args)
    bwd_args = (torch.randn_like(out), q, k, v, out, lse) + fwd_args[3:] + (False,)
    torch.library.opcheck(torch.ops.flash_cuda.bwd.default, bwd_args)


@pytest.mark.fast
def test_direct_op_errors_are_clear():
    """Calls that bypass the Python checks still get a clear error, not a crash."""
    d, dtype = FAST_HEAD_DIMS[0], DTYPES[0]
    q = make((1, 8, 2, d), dtype)
    with pytest.raises(ValueError, match="must be a multiple of the number of heads of k"):
        torch.ops.flash_cuda.fwd(q, make((1, 8, 3, d), dtype), make((1, 8, 3, d), dtype), None,
                                 None, None, None, 8, 8, 1.0, False, -1, -1)
    out, lse = torch.ops.flash_cuda.fwd(q, q, q, None, None, None, None, 8, 8, 1.0, False, -1, -1)
    if not has_backward(d):
        return
    with pytest.raises(ValueError, match="softmax_lse must be the forward's"):
        torch.ops.flash_cuda.bwd(out, q, q, q, out, lse[:, :, :4].contiguous(), None, None, None,
                                 None, 8, 8, 1.0, False, -1, -1, False)
    with pytest.raises(NotImplementedError, match="deterministic"):
        torch.ops.flash_cuda.bwd(out, q, q, q, out, lse, None, None, None, None, 8, 8, 1.0, False,
                                 -1, -1, True)


@pytest.mark.fast
def test_nan_in_unused_rows_does_not_leak():
    """Rows past seqused (an unwritten KV cache slot, say) are never read into the MMAs."""
    from flash_cuda import flash_attn_func
    d, dtype = FAST_HEAD_DIMS[0], DTYPES[0]
    q, k, v = (make((2, 200, 2, d), dtype) for _ in range(3))
    used = torch.tensor([150, 77], dtype=torch.int32, device="cuda")
    for t in (q, k, v):
        t[0, 150:] = float("nan")
        t[1, 77:] = float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    from flash_cuda import flash_attn_varlen_func
    cu = torch.tensor([0, 200, 400], dtype=torch.int32, device="cuda")
    flat = [t.reshape(400, 2, d) for t in (q, k, v)]
    out = flash_attn_varlen_func(*flat, cu, cu, 200, 200, seqused_q=used, seqused_k=used,
                                 causal=True)
    assert torch.isfinite(out).all()
    if has_backward(d):
        out.backward(torch.randn_like(out))
        for g in (q.grad, k.grad, v.grad):
            assert torch.isfinite(g).all()
    ref = flash_attn_func(q[:1, :150].detach(), k[:1, :150].detach(), v[:1, :150].detach(),
                          causal=True)
    assert torch.equal(out[:150], ref[0])
    assert (out[150:200] == 0).all()


@pytest.mark.fast
def test_contiguous_view_at_odd_offset():
    from flash_cuda import flash_attn_func
    d, dtype = FAST_HEAD_DIMS[0], DTYPES[0]
    buf = torch.randn(2 * 50 * 2 * d + 1, device="cuda", dtype=dtype)
    q = buf[1:].view(2, 50, 2, d)  # contiguous, but rows start 2 bytes off 16-byte alignment
    out = flash_attn_func(q, q, q)
    assert torch.equal(out, flash_attn_func(q.clone(), q.clone(), q.clone()))


@pytest.mark.fast
def test_huge_window_is_no_window():
    from flash_cuda import flash_attn_func
    d, dtype = FAST_HEAD_DIMS[0], DTYPES[0]
    q, k, v = make((1, 100, 2, d), dtype), make((1, 3, 2, d), dtype), make((1, 3, 2, d), dtype)
    ref = flash_attn_func(q, k, v)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(2**31 - 1, 2**40)), ref)


# Run in a child process with FLASH_CUDA_SMEM_LIMIT_KB=99, which makes the launcher treat this
# GPU as one with 99 KB of shared memory per block (sm86 / sm89 / sm120).
_SMALL_SMEM_CHILD = """
import math, sys, torch
sys.path.insert(0, sys.argv[1])
import test_kernels as t
from flash_cuda import flash_attn_func
for (sq, sk), window, causal in [((113, 203), (-1, -1), False), ((1000, 512), (-1, -1), True),
                                 ((512, 1000), (17, 5), False), ((17, 17), (-1, 3), True)]:
    for dtype in t.DTYPES:
        q = t.make((2, sq, 4, 256), dtype)
        k, v = (t.make((2, sk, 2, 256), dtype) for _ in range(2))
        scale = 1 / 16

        def ours(q_, k_, v_):
            return flash_attn_func(q_, k_, v_, softmax_scale=scale, causal=causal,
                                   window_size=window, return_attn_probs=True)

        t.run_and_check(q, k, v, ours, dict(softmax_scale=scale, causal=causal,
                                            window_left=window[0], window_right=window[1]),
                        check_grad=False)
# Witness that the limit took effect: a launch that needs more than 99 KB is refused.
info = t.build_info()["head_dims"]
if 192 in info["fwd"]:
    q, witness = t.make((1, 64, 2, 192), t.DTYPES[0]), "the hdim-192 forward"
    run = lambda: flash_attn_func(q, q, q)
elif 256 in info.get("bwd", []):
    q, witness = t.make((1, 64, 2, 256), t.DTYPES[0], True), "the hdim-256 backward"
    run = lambda: flash_attn_func(q, q, q).sum().backward()
else:
    print("no witness compiled")
    sys.exit(3)
try:
    run()
except RuntimeError as e:
    assert "needs more shared memory per block than this GPU offers" in str(e), e
else:
    raise AssertionError(witness + " ran within 99 KB of shared memory per block")
print("small-smem OK")
"""


@pytest.mark.fast
def test_99kb_gpus_run_the_small_forward_tiles():
    """Head dim 256's forward tile needs 112 KB; on GPUs with 99 KB per block the launcher runs
    FwdTileConfigSmall instead, and tiles that need more (hdim-192 forward, every backward) raise
    the clear error."""
    import os
    import subprocess
    import sys
    if 256 not in compiled_head_dims():
        pytest.skip("head dim 256 is not compiled")
    # The fallback from a family whose tile does not fit is what is tested: not strict.
    env = dict(os.environ, FLASH_CUDA_SMEM_LIMIT_KB="99", FLASH_CUDA_FAMILY_STRICT="0")
    child = subprocess.run([sys.executable, "-c", _SMALL_SMEM_CHILD, os.path.dirname(__file__)],
                           env=env, capture_output=True, text=True, timeout=300)
    if child.returncode == 3 and "no witness compiled" in child.stdout:
        pytest.skip("neither the hdim-192 forward nor the hdim-256 backward is compiled, so "
                    "nothing shows that the 99 KB limit took effect")
    assert child.returncode == 0 and "small-smem OK" in child.stdout, child.stderr[-3000:]


@pytest.mark.fast
@pytest.mark.parametrize("varlen", [False, True])
def test_forward_is_bitwise_reproducible(varlen):
    """20 reruns of one forward give out and lse equal bit for bit: no atomics, no split of the
    keys, one order of summation per row."""
    from flash_cuda import flash_attn_func, flash_attn_varlen_func
    d, dtype = compiled_head_dims()[0], DTYPES[0]
    if varlen:
        lens = [300, 0, 1000, 17]
        cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
        q = make((sum(lens), 8, d), dtype)
        k, v = (make((sum(lens), 2, d), dtype) for _ in range(2))

        def call():
            return flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                          return_attn_probs=True)
    else:
        q = make((2, 1000, 8, d), dtype)
        k, v = (make((2, 1000, 2, d), dtype) for _ in range(2))

        def call():
            return flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    out, lse = call()
    for _ in range(19):
        poison_allocator()
        again_out, again_lse = call()
        assert torch.equal(again_out, out) and torch.equal(again_lse, lse)
