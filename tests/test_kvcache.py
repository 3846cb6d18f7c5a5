"""flash_attn_with_kvcache and torch.ops.flash_cuda.fwd_kvcache: the API over the op, the op's
rules and not-yet-implemented arguments, its declared mutation of the caches (opcheck), a decode
step under torch.compile(fullgraph=True), and the clear error on CUDA from a build without
KV-cache kernels (FLASH_CUDA_DISABLE_KVCACHE=1); tests/test_kvcache_cuda.py runs the kernels."""

import pytest
import torch

import flash_cuda
from flash_cuda import flash_attn_with_kvcache
from flash_cuda.reference_kvcache import kvcache_forward_reference

from conftest import first_error_line, real_and_fake_errors

B, HQ, HK, D, CAP = 2, 4, 2, 64, 48


def case(seqlen_q=1, n_new=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, seqlen_q, HQ, D, generator=g, dtype=dtype)
    k_cache, v_cache = (torch.randn(B, CAP, HK, D, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, n_new, HK, D, generator=g, dtype=dtype) for _ in range(2))
    cos = torch.randn(64, 16, generator=g)
    return q, k_cache, v_cache, k, v, cos, torch.randn(64, 16, generator=g)


@pytest.mark.parametrize("paged", [False, True])
def test_api_appends_rotates_and_attends(paged):
    q, k_cache, v_cache, k, v, cos, sin = case(seqlen_q=3, n_new=3)
    lengths = torch.tensor([4, 30], dtype=torch.int32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    want = kvcache_forward_reference(q, ref_k, ref_v, k, v, cos, sin, cache_seqlens=lengths,
                                     causal=True)
    kwargs = {}
    if paged:  # pages of 16 rows in reverse order
        (k_cache, table), (v_cache, _) = _paged(k_cache, 16), _paged(v_cache, 16)
        kwargs = {"page_table": table}
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos,
                                       rotary_sin=sin, cache_seqlens=lengths, causal=True,
                                       return_softmax_lse=True, **kwargs)
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, want[1], atol=0, rtol=0)
    row = (table[1, 30 // 16], 30 % 16) if paged else (1, 30)
    torch.testing.assert_close(k_cache[row], ref_k[1, 30])  # the new key landed in the cache


def test_int_cache_seqlens_and_defaults():
    q, k_cache, v_cache, k, v, _, _ = case()
    out = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=7)
    want = kvcache_forward_reference(q, k_cache, v_cache, k, v, cache_seqlens=7,
                                     softmax_scale=D ** -0.5)
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)


def test_out_is_written_in_place():
    q, k_cache, v_cache, k, v, _, _ = case(seqlen_q=2, n_new=2)
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=5)
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5, out=out,
                                       return_softmax_lse=True)
    assert got is out and lse.shape == (B, HQ, 2)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    for bad, match in ((torch.empty(B, 2, HQ, D + 8), "out must have q's shape"),
                       (torch.empty(B, 2, HQ, 2 * D)[..., ::2], "contiguous last dimension")):
        with pytest.raises(ValueError, match=match):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5, out=bad)


@pytest.mark.parametrize("name, value", [("qv", "tensor"), ("q_descale", "tensor"),
                                         ("softcap", 1.0), ("attention_chunk", 8)])
def test_not_implemented_arguments_name_themselves(name, value):
    q, k_cache, v_cache, _, _, _, _ = case()
    value = torch.zeros(1) if value == "tensor" else value
    with pytest.raises(NotImplementedError, match=name):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, **{name: value})


@pytest.mark.parametrize("change, match", [
    (dict(k="alone"), "k and v go together"),
    (dict(page_table=True, cache_batch_idx=True), "pass one or the other"),
    (dict(cache_seqlens=torch.tensor([1, 2])), "cache_seqlens must have dtype int32"),
    (dict(rotary_dim=8), "rotary dim"),
    (dict(cache_dtype=torch.float16), "k_cache must have q's dtype"),
    (dict(cache_seqlens=None), "cache_seqlens .* is required"),
    (dict(cache_rows=1), "pass cache_batch_idx to pick rows"),
    (dict(cache_rows=0), "k_cache has no rows"),
])
def test_op_rules_name_the_argument(change, match):
    q, k_cache, v_cache, k, v, cos, sin = case()
    args = dict(k=k, v=v, cache_seqlens=torch.tensor([1, 2], dtype=torch.int32))
    if change.get("k") == "alone":
        args.pop("v")
    if change.get("page_table"):
        args.update(page_table=torch.zeros(B, 3, dtype=torch.int32),
                    cache_batch_idx=torch.zeros(B, dtype=torch.int32))
    if "rotary_dim" in change:
        args.update(rotary_cos=cos[:, :change["rotary_dim"] // 2],
                    rotary_sin=sin[:, :change["rotary_dim"] // 2])
    if "cache_dtype" in change:
        k_cache = k_cache.to(change["cache_dtype"])
    if "cache_rows" in change:
        k_cache, v_cache = k_cache[:change["cache_rows"]], v_cache[:change["cache_rows"]]
    if "cache_seqlens" in change:
        args["cache_seqlens"] = change["cache_seqlens"]
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(q, k_cache, v_cache, **args)


def _op_args(q, k_cache, v_cache, k, v, cos, sin):
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    return (q, k_cache, v_cache, k, v, cos, sin, lengths, None, None, None, None, None, None,
            None, D ** -0.5, True, -1, -1, True, 0, torch.empty_like(q))


def test_opcheck_declares_the_cache_mutation():
    """opcheck's schema test fails when an op writes a tensor its schema does not mark (a!)."""
    q, k_cache, v_cache, k, v, cos, sin = case(seqlen_q=2, n_new=2)
    torch.library.opcheck(torch.ops.flash_cuda.fwd_kvcache.default,
                          _op_args(q, k_cache, v_cache, k, v, cos, sin))


def test_decode_step_compiles_fullgraph():
    q, k_cache, v_cache, k, v, _, _ = case()
    lengths = torch.tensor([3, 9], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                       causal=True)

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = step(q, eager_k, eager_v, k, v)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, k, v)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, eager_k, atol=0, rtol=0)  # the compiled step wrote it


def test_scheduler_metadata_inside_a_compiled_step():
    """get_scheduler_metadata traced with the step: its count is a constant of the graph."""
    from flash_cuda import get_scheduler_metadata
    q, k_cache, v_cache, k, v, _, _ = case()
    lengths = torch.tensor([3, 9], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v):
        meta = get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, qkv_dtype=torch.float16,
                                      num_splits=3)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                      causal=True, scheduler_metadata=meta)
        return out, meta

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want, want_meta = step(q, eager_k, eager_v, k, v)
    got, got_meta = torch.compile(step, fullgraph=True, backend="aot_eager")(
        q, k_cache, v_cache, k, v)
    assert got_meta.shape == want_meta.shape == (3,)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, eager_k, atol=0, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_without_kvcache_kernels_says_so():
    if flash_cuda.build_info()["head_dims"]["fwd_kvcache"]:
        pytest.skip("this build holds KV-cache kernels (tests/test_kvcache_cuda.py runs them)")
    q, k_cache, v_cache, k, v, _, _ = (t.cuda() for t in case(dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="without"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)


def test_exported_from_the_package():
    assert "flash_attn_with_kvcache" in flash_cuda.__all__


def _paged(cache, page):
    """cache (B, CAP, heads, d) as pages of `page` rows, handed out in reverse order."""
    pages = CAP // page
    table = torch.arange(B * pages - 1, -1, -1, dtype=torch.int32).view(B, pages)
    paged = torch.empty(B * pages, page, *cache.shape[2:], dtype=cache.dtype)
    for b in range(B):
        for p in range(pages):
            paged[table[b, p]] = cache[b, p * page:(p + 1) * page]
    return paged, table


@pytest.mark.parametrize("layout", ["dense", "page_table", "block_table"])
def test_varlen_inference_call_shape(layout):
    """flash_attn_varlen_func(cu_seqlens_k=None, seqused_k=...) over a cache: each sequence
    attends to the first seqused_k[b] keys of its cache row, bottom-right causal."""
    from flash_cuda import flash_attn_varlen_func
    from flash_cuda.reference import attention_forward_reference
    q, k_cache, v_cache, _, _, _, _ = case(seqlen_q=3)
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)  # 3 query rows, then 1
    q = q.flatten(0, 1)[:4]
    used = torch.tensor([20, 7], dtype=torch.int32)
    want_out, want_lse = [], []
    for b in range(B):
        o, lse = attention_forward_reference(
            q[cu_q[b]:cu_q[b + 1]][None], k_cache[b:b + 1, :used[b]],
            v_cache[b:b + 1, :used[b]], softmax_scale=D ** -0.5, causal=True)
        want_out.append(o[0])
        want_lse.append(lse[0])
    kwargs = {}
    if layout != "dense":
        (k_cache, table), (v_cache, _) = _paged(k_cache, 16), _paged(v_cache, 16)
        kwargs[layout] = table
    out = torch.full_like(q, float("nan"))
    got, lse = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 3, None, seqused_k=used,
                                      causal=True, return_attn_probs=True, out=out, **kwargs)
    assert got is out
    torch.testing.assert_close(out, torch.cat(want_out), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, torch.cat(want_lse, dim=1), atol=1e-6, rtol=1e-5)


def test_varlen_inference_call_shape_rules():
    from flash_cuda import flash_attn_varlen_func
    q, k_cache, v_cache, _, _, _, _ = case()
    q = q.flatten(0, 1)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    used = torch.tensor([4, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="seqused_k .* gives each sequence's key count"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None)
    with pytest.raises(NotImplementedError, match="seqused_q"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None, seqused_q=used,
                               seqused_k=used)
    with pytest.raises(NotImplementedError, match="forward only"):
        flash_attn_varlen_func(q.requires_grad_(), k_cache, v_cache, cu_q, None, 1, None,
                               seqused_k=used)
    with pytest.raises(ValueError, match="two names for one argument"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, None, seqused_k=used,
                               page_table=torch.zeros(B, 3, dtype=torch.int32),
                               block_table=torch.zeros(B, 3, dtype=torch.int32))


def test_scheduler_metadata_fixes_the_split_count():
    from flash_cuda import get_scheduler_metadata
    q, k_cache, v_cache, k, v, _, _ = case()
    lengths = torch.tensor([3, 9], dtype=torch.int32)
    meta = get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, qkv_dtype=torch.float16,
                                  num_splits=3)
    assert meta.dtype == torch.int32 and meta.shape == (3,)
    assert get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths).shape == (1,)  # CPU: no split
    want = flash_attn_with_kvcache(q, k_cache.clone(), v_cache.clone(), k, v,
                                   cache_seqlens=lengths)
    got = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths,
                                  scheduler_metadata=meta)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, num_splits=500).shape == (256,)
    with pytest.raises(ValueError, match="must be what get_scheduler_metadata returns"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                scheduler_metadata=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="headdim_v"):
        get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, headdim_v=D // 2)
    with pytest.raises(ValueError, match="page_size must be at least 1"):
        get_scheduler_metadata(B, 1, CAP, HQ, HK, D, lengths, page_size=0)


@pytest.mark.parametrize("paged", [False, True])
def test_head_major_caches_are_read_and_written_in_place(paged):
    """Caches stored heads before rows ("HND": (B, heads, rows, d) or (pages, heads, page, d)
    memory, passed as the transposed view) give the results of row-major ones, bit for bit, and
    the new keys land in that memory."""
    q, k_cache, v_cache, k, v, cos, sin = case(seqlen_q=2, n_new=2)
    lengths = torch.tensor([5, 33], dtype=torch.int32)
    kwargs = {}
    if paged:
        (k_cache, table), (v_cache, _) = _paged(k_cache, 16), _paged(v_cache, 16)
        kwargs = {"page_table": table}
    args = dict(rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=True,
                return_softmax_lse=True, **kwargs)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = flash_attn_with_kvcache(q, want_k, want_v, k, v, **args)
    hnd_k, hnd_v = (c.transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    got = flash_attn_with_kvcache(q, hnd_k.transpose(1, 2), hnd_v.transpose(1, 2), k, v, **args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    torch.testing.assert_close(hnd_k.transpose(1, 2), want_k, atol=0, rtol=0)
    torch.testing.assert_close(hnd_v.transpose(1, 2), want_v, atol=0, rtol=0)
    assert not torch.equal(want_k, k_cache)  # the append wrote something to compare


# ---- the op's rules, one bad argument at a time: the CPU kernel and, on CUDA, the C++ kernel
# against the fake one, word for word (Note [Checks in two places] in csrc/ops/attention_cuda.cpp)

def _good_op_args(device):
    """A valid fwd_kvcache call (2 sequences, one new token each, 4 / 2 heads, head dim 64)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q = rand(B, 1, HQ, D)
    return dict(q=q, k_cache=rand(B, CAP, HK, D), v_cache=rand(B, CAP, HK, D),
                k=rand(B, 1, HK, D), v=rand(B, 1, HK, D), rotary_cos=None, rotary_sin=None,
                cache_seqlens=torch.tensor([3, 9], dtype=torch.int32, device=device),
                cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                softmax_scale=D ** -0.5, causal=True, window_left=-1, window_right=-1,
                rotary_interleaved=True, num_splits=0, out=torch.empty_like(q))


def _int32(a, values):
    return torch.tensor(values, dtype=torch.int32, device=a["q"].device)


def _rotary(a, rows=16, half=8):
    t = torch.randn(rows, half, device=a["q"].device)
    return dict(rotary_cos=t, rotary_sin=t.clone())


def _varlen_q(a):
    q = a["q"].flatten(0, 1)
    return dict(q=q, out=torch.empty_like(q), cu_seqlens_q=_int32(a, [0, 1, 2]))


def _with(**changes):
    return lambda a: changes


OP_CASES = [
    ("q_float64", lambda a: dict(q=a["q"].double()), "q has dtype float64"),
    ("q_3d", lambda a: dict(q=a["q"][0]), "q must be 4-D"),
    ("k_cache_3d", lambda a: dict(k_cache=a["k_cache"][0]), "k_cache must be 4-D"),
    ("k_cache_dtype", lambda a: dict(k_cache=a["k_cache"].half()), "k_cache must have q's dtype"),
    ("v_cache_heads", lambda a: dict(v_cache=a["v_cache"][:, :, :1]), "v_cache must have 2 heads"),
    ("k_cache_strided", lambda a: dict(k_cache=a["k_cache"].repeat_interleave(2, -1)[..., ::2]),
     "k_cache must have a contiguous last dimension"),
    ("cache_shapes", lambda a: dict(v_cache=a["v_cache"][:, :7]), "must have the same shape"),
    ("head_dim_12", lambda a: {n: a[n][..., :12].contiguous()
                               for n in ("q", "k_cache", "v_cache", "k", "v", "out")},
     "multiple of 8"),
    ("heads_3_on_2", lambda a: dict(q=a["q"][:, :, :3], out=a["out"][:, :, :3]),
     "must be a multiple of the number of heads of the cache"),
    ("cu_seqlens_q_0d", lambda a: {**_varlen_q(a), "cu_seqlens_q": _int32(a, 0),
                                   "max_seqlen_q": 1}, "cu_seqlens_q must be 1-D"),
    ("cu_seqlens_q_int64", lambda a: {**_varlen_q(a), "max_seqlen_q": 1,
                                      "cu_seqlens_q": _int32(a, [0, 1, 2]).long()},
     "cu_seqlens_q must have dtype int32"),
    ("no_max_seqlen_q", _varlen_q, "max_seqlen_q is required"),
    ("max_seqlen_q_negative", lambda a: {**_varlen_q(a), "max_seqlen_q": -1},
     "max_seqlen_q must be >= 0"),
    ("k_alone", _with(v=None), "k and v go together"),
    ("cu_seqlens_k_new_alone", lambda a: dict(k=None, v=None,
                                              cu_seqlens_k_new=_int32(a, [0, 1, 2])),
     "cu_seqlens_k_new describes packed new keys"),
    ("k_batch", lambda a: dict(k=a["k"][:1], v=a["v"][:1]), "k and v must have q's batch size"),
    ("k_v_shapes", lambda a: dict(v=torch.cat([a["v"], a["v"]], 1)),
     "k and v must have the same shape"),
    ("no_cache_seqlens", _with(cache_seqlens=None), "cache_seqlens .* is required"),
    ("cache_seqlens_length", lambda a: dict(cache_seqlens=_int32(a, [3])),
     "cache_seqlens must be 1-D with 2 entries"),
    ("cache_leftpad_int64", lambda a: dict(cache_leftpad=_int32(a, [0, 0]).long()),
     "cache_leftpad must have dtype int32"),
    ("page_table_int64", lambda a: dict(page_table=_int32(a, [[0], [1]]).long()),
     "page_table must be int32"),
    ("page_table_and_batch_idx", lambda a: dict(page_table=_int32(a, [[0], [1]]),
                                                cache_batch_idx=_int32(a, [0, 1])),
     "pass one or the other"),
    ("cache_no_rows", lambda a: dict(k_cache=a["k_cache"][:0], v_cache=a["v_cache"][:0]),
     "k_cache has no rows"),
    ("cache_one_row", lambda a: dict(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]),
     "pass cache_batch_idx to pick rows"),
    ("rotary_cos_alone", lambda a: dict(rotary_cos=_rotary(a)["rotary_cos"]),
     "rotary_cos and rotary_sin go together"),
    ("rotary_without_k", lambda a: dict(k=None, v=None, **_rotary(a)), "rotate the new keys"),
    ("rotary_shapes", lambda a: {**_rotary(a), "rotary_sin": _rotary(a, rows=8)["rotary_sin"]},
     "rotary_sin must be 2-D"),
    ("rotary_no_rows", lambda a: _rotary(a, rows=0), "at least one position"),
    ("rotary_dim_8", lambda a: _rotary(a, half=4), "the rotary dim"),
    ("out_shape", lambda a: dict(out=a["out"][:, :, :2]), "out must have q's shape"),
    ("out_strided", lambda a: dict(out=a["out"].repeat_interleave(2, -1)[..., ::2]),
     "out must have a contiguous last dimension"),
    ("window", _with(window_left=-2), "window_size entries must be >= -1"),
    ("scale", _with(softmax_scale=0.0), "softmax_scale must be a finite number"),
]


def _bad_op_args(changes, device):
    a = _good_op_args(device)
    a.update(changes(a))
    return a


@pytest.mark.parametrize("changes, match", [pytest.param(c[1], c[2], id=c[0]) for c in OP_CASES])
def test_op_rule_of_each_argument(changes, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.flash_cuda.fwd_kvcache(**_bad_op_args(changes, "cpu"))




@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("changes", [pytest.param(c[1], id=c[0]) for c in OP_CASES])
def test_cuda_and_fake_kernels_say_the_same(changes):
    """The C++ checks of the CUDA kernel and the Python checks of the fake kernel (what
    torch.compile meets) on the same CUDA inputs: the same exception, word for word."""
    if not flash_cuda.build_info()["head_dims"]["fwd_kvcache"]:
        pytest.skip("this build holds no KV-cache kernels")
    args = _bad_op_args(changes, "cuda")
    real, fake = real_and_fake_errors(torch.ops.flash_cuda.fwd_kvcache, args)
    assert real is not None and real == fake


_RULES_SOURCE = r"""
#include <torch/library.h>
#include "ops/kvcache_checks.h"
using OptTensor = std::optional<at::Tensor>;
at::Tensor rules(const at::Tensor& q, at::Tensor& k_cache, at::Tensor& v_cache,
                 const OptTensor& k, const OptTensor& v, const OptTensor& rotary_cos,
                 const OptTensor& rotary_sin, const OptTensor& cache_seqlens,
                 const OptTensor& cache_batch_idx, const OptTensor& cache_leftpad,
                 const OptTensor& page_table, const OptTensor& cu_seqlens_q,
                 const OptTensor& cu_seqlens_k_new, std::optional<int64_t> max_seqlen_q,
                 const OptTensor& rotary_seqlens, double softmax_scale, bool causal,
                 int64_t window_left, int64_t window_right, bool rotary_interleaved,
                 int64_t num_splits, at::Tensor& out) {
  flash_cuda::check_kvcache_op(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                               cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q,
                               cu_seqlens_k_new, max_seqlen_q, rotary_seqlens, softmax_scale,
                               window_left, window_right, out);
  return q;
}
TORCH_LIBRARY(flash_cuda_rules, m) { m.def("kvcache%s"); }
TORCH_LIBRARY_IMPL(flash_cuda_rules, CPU, m) { m.impl("kvcache", &rules); }
"""


@pytest.fixture(scope="module")
def cpp_rules():
    """csrc/ops/kvcache_checks.h (the CUDA kernel's rules) compiled for CPU tensors, as the op
    flash_cuda_rules.kvcache with fwd_kvcache's arguments (about 30 s of g++)."""
    import os
    from torch.utils.cpp_extension import load_inline
    schema = torch.ops.flash_cuda.fwd_kvcache.default._schema
    arguments = str(schema)[len("flash_cuda::fwd_kvcache"):]
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    load_inline("flash_cuda_rules", cpp_sources=[_RULES_SOURCE % arguments.replace('"', '')],
                extra_include_paths=[csrc], extra_cflags=["-O0", "-g0"],
                is_python_module=False)
    return torch.ops.flash_cuda_rules.kvcache


@pytest.mark.parametrize("changes", [pytest.param(c[1], id=c[0]) for c in OP_CASES])
def test_cpp_and_python_rules_say_the_same(cpp_rules, changes):
    """The C++ rules of the CUDA kernel and the Python ones of the CPU kernel on the same CPU
    inputs: the same exception, word for word (what the CUDA test below checks on a GPU, here
    without one)."""
    args = _bad_op_args(changes, "cpu")
    python = first_error_line(lambda: torch.ops.flash_cuda.fwd_kvcache(**args))
    cpp = first_error_line(lambda: cpp_rules(**args))
    assert python is not None and python == cpp


def _paged_args(a):
    return dict(k_cache=a["k_cache"].reshape(B * 3, CAP // 3, HK, D),
                v_cache=a["v_cache"].reshape(B * 3, CAP // 3, HK, D),
                page_table=_int32(a, [[5, 4, 3], [2, 1, 0]]))


def _packed_new_keys(a):
    return dict(k=a["k"].flatten(0, 1), v=a["v"].flatten(0, 1),
                cu_seqlens_k_new=_int32(a, [0, 1, 2]))


VALID_CHANGES = [
    ("dense", lambda a: {}),
    ("no_new_keys", _with(k=None, v=None)),
    ("paged", _paged_args),
    ("varlen_q", lambda a: {**_varlen_q(a), "max_seqlen_q": 1}),
    ("varlen_q_packed_new_keys", lambda a: {**_varlen_q(a), "max_seqlen_q": 1,
                                            **_packed_new_keys(a)}),
    ("empty_batch", lambda a: dict(q=a["q"][:0].flatten(0, 1), out=a["out"][:0].flatten(0, 1),
                                   cu_seqlens_q=_int32(a, [0]), max_seqlen_q=0, k=None, v=None,
                                   cache_seqlens=None)),
    ("rotary", lambda a: {**_rotary(a), "rotary_seqlens": _int32(a, [1, 2])}),
    ("batch_idx", lambda a: dict(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1],
                                 cache_batch_idx=_int32(a, [0, 0]))),
    ("leftpad_window", lambda a: dict(cache_leftpad=_int32(a, [1, 0]), window_left=5,
                                      window_right=0)),
    ("mqa_head_dim_8", lambda a: {n: a[n][..., :1, :8].contiguous()
                                  for n in ("k_cache", "v_cache", "k", "v")} |
     {n: a[n][..., :8].contiguous() for n in ("q", "out")}),
]


@pytest.mark.parametrize("changes", [pytest.param(c[1], id=c[0]) for c in VALID_CHANGES])
def test_cpp_rules_pass_what_python_passes(cpp_rules, changes):
    args = _bad_op_args(changes, "cpu")
    assert first_error_line(lambda: torch.ops.flash_cuda.fwd_kvcache(**args)) is None
    assert first_error_line(lambda: cpp_rules(**args)) is None


def _cuda_kernel_on_cpu_tensors(args):
    """fwd_kvcache's CUDA kernel called with CPU tensors (through the CUDA dispatch key): its
    rules run before it touches a device, so a build with CUDA kernels checks them without one."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    return torch.ops.flash_cuda.fwd_kvcache.default.redispatch(keys, **args)


@pytest.mark.skipif(not flash_cuda.build_info()["head_dims"]["fwd_kvcache"],
                    reason="a build without KV-cache kernels has no C++ CUDA kernel to call")
@pytest.mark.parametrize("changes", [pytest.param(c[1], id=c[0]) for c in OP_CASES])
def test_cuda_kernel_and_python_rules_say_the_same(changes):
    """The compiled CUDA kernel's rules (csrc/ops/kvcache_cuda.cpp calling kvcache_checks.h)
    against the Python ones, on CPU tensors: no GPU needed."""
    args = _bad_op_args(changes, "cpu")
    python = first_error_line(lambda: torch.ops.flash_cuda.fwd_kvcache(**args))
    assert python is not None and python == first_error_line(lambda: _cuda_kernel_on_cpu_tensors(args))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_op_with_a_cpu_index_tensor_names_it():
    if not flash_cuda.build_info()["head_dims"]["fwd_kvcache"]:
        pytest.skip("this build holds no KV-cache kernels")
    args = _good_op_args("cuda")
    args["cache_seqlens"] = args["cache_seqlens"].cpu()
    with pytest.raises(ValueError, match=r"cache_seqlens must be on q's device \(cuda:0\)"):
        torch.ops.flash_cuda.fwd_kvcache(**args)
