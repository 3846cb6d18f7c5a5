"""flash_attn_with_kvcache on CUDA against the float32 reference of reference_kvcache.py: dense
and paged caches (pages of 1, 3, 16, 256 rows), append with and without rotary (both layouts),
cache_batch_idx, cache_leftpad, packed q, causal and windows, GQA, splits 1, 3 and the
heuristic's, caches laid out heads before rows ("HND"); outputs poisoned with the dtype's NaN;
the caches' new rows; a decode step captured in a CUDA graph and replayed with new
cache_seqlens; steps queued without a sync against the same steps run one at a time."""

import math
import os
import subprocess
import sys

import pytest
import torch

from flash_cuda.reference_kvcache import kvcache_forward_reference

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="needs a CUDA device")]


def _build():
    import flash_cuda
    info = flash_cuda.build_info()
    dtypes = [dt for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16))
              if name in info["dtypes"]]
    return dtypes, sorted(info["head_dims"].get("fwd_kvcache", []))


DTYPES, HEAD_DIMS = _build() if torch.cuda.is_available() else ([], [])


def poison(t):
    """t filled with 0x7FFF: a NaN in bfloat16 and float16 alike."""
    return t.view(torch.int16).fill_(0x7FFF).view(t.dtype) if t.element_size() == 2 else t


def max_err(a, b):
    a, b = a.float(), b.float()
    both_inf = torch.isinf(a) & torch.isinf(b) & (a.sign() == b.sign())
    diff = (a - b).abs().masked_fill(both_inf, 0)
    return diff.nan_to_num(nan=float("inf")).max().item() if diff.numel() else 0.0


def check(name, ours, ref, ref_lowp, atol=1e-3):
    assert not torch.isnan(ours).any(), f"{name} holds NaN (unwritten or bad arithmetic)"
    err, base = max_err(ours, ref), max_err(ref_lowp, ref)
    assert err <= 2 * base + atol, f"{name}: error {err:.3e} > 2 x {base:.3e} + {atol:.1e}"


def paged(cache, page_size, gen):
    """The dense (batch, cap, heads, d) cache as pages in a random order, and its table."""
    batch, cap = cache.shape[:2]
    per_seq = -(-cap // page_size)
    order = torch.randperm(batch * per_seq, generator=gen).to(torch.int32).view(batch, per_seq)
    padded = cache.new_zeros(batch, per_seq * page_size, *cache.shape[2:])
    padded[:, :cap] = cache
    pages = cache.new_empty(batch * per_seq, page_size, *cache.shape[2:])
    pages[order.flatten().long().to(cache.device)] = padded.view(-1, page_size, *cache.shape[2:])
    return pages, order.to(cache.device)


def run_case(dtype, d, *, batch=3, seqlen_q=1, heads=(8, 2), cap=300, lengths=(0, 17, 280),
             n_new=1, page_size=None, rotary=None, batch_idx=False, leftpad=False,
             varlen_q=False, causal=True, window=(-1, -1), num_splits=0, hnd=False,
             rotary_seqlens=False, poison_tail=False, seed=0):
    from flash_cuda import flash_attn_with_kvcache
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", dtype)

    q = randn(batch, seqlen_q, hq, d)
    cache_rows = batch + 2 if batch_idx else batch
    k_cache, v_cache = randn(cache_rows, cap, hk, d), randn(cache_rows, cap, hk, d)
    k = v = None
    if n_new:
        k, v = randn(batch, n_new, hk, d), randn(batch, n_new, hk, d)
    lens = torch.tensor(lengths[:batch], dtype=torch.int32, device="cuda")
    kwargs = dict(cache_seqlens=lens, causal=causal, window_size=window,
                  softmax_scale=1 / math.sqrt(d), num_splits=num_splits)
    if rotary is not None:
        rd = min(d, 32)
        angles = torch.rand(cap + 8, rd // 2, generator=gen) * 6.28
        kwargs.update(rotary_cos=angles.cos().to("cuda", dtype),
                      rotary_sin=angles.sin().to("cuda", dtype),
                      rotary_interleaved=rotary == "interleaved")
        if rotary_seqlens:  # positions of their own, 5 rows past the cache lengths
            kwargs["rotary_seqlens"] = lens + 5
    if batch_idx:
        kwargs["cache_batch_idx"] = torch.randperm(cache_rows, generator=gen)[:batch].to(
            torch.int32).cuda()
    if leftpad:  # True: pads of 3, 0, 5 rows; or the pads themselves
        pads = list(leftpad) if isinstance(leftpad, tuple) else [3, 0, 5]
        kwargs["cache_leftpad"] = torch.minimum(lens, torch.tensor(
            pads[:batch], dtype=torch.int32, device="cuda"))
    if varlen_q:
        q = q.flatten(0, 1)
        kwargs["cu_seqlens_q"] = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q,
                                              dtype=torch.int32, device="cuda")
        kwargs["max_seqlen_q"] = seqlen_q
    ref_k, ref_v = k_cache.float().cpu(), v_cache.float().cpu()  # the dense reference caches
    lowp_k, lowp_v = k_cache.cpu(), v_cache.cpu()
    if poison_tail:  # cache rows past each sequence's keys hold NaN: none may reach out
        for b in range(batch):
            c = int(kwargs["cache_batch_idx"][b]) if "cache_batch_idx" in kwargs else b
            end = int(lens[b]) + (n_new or 0)
            k_cache[c, end:] = float("nan")
            v_cache[c, end:] = float("nan")
    if page_size is not None:
        k_cache, table = paged(k_cache, page_size, gen)
        v_cache = paged_like(table, page_size, v_cache)
        kwargs["page_table"] = table
    if hnd:  # heads before rows in memory ("HND"), passed as the (rows, heads) view
        k_cache, v_cache = (c.transpose(1, 2).contiguous().transpose(1, 2)
                            for c in (k_cache, v_cache))
    cpu = {key: (val.cpu() if isinstance(val, torch.Tensor) else val)
           for key, val in kwargs.items()
           if key not in ("num_splits", "page_table", "max_seqlen_q")}
    new_kv = (k.cpu() if k is not None else None, v.cpu() if v is not None else None)
    want = kvcache_forward_reference(
        q.cpu().float(), ref_k, ref_v, *(t.float() if t is not None else None for t in new_kv),
        **{**cpu, **_float_rotary(cpu)})
    want_lp = kvcache_forward_reference(q.cpu(), lowp_k, lowp_v, *new_kv, upcast=False, **cpu)
    out = poison(torch.empty_like(q))
    got, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, out=out,
                                       return_softmax_lse=True, **kwargs)
    torch.cuda.synchronize()
    check("out", got.cpu(), want[0], want_lp[0])
    check("lse", lse.cpu(), want[1], want_lp[1])
    if n_new:  # the new rows landed (rotated) where the reference put them
        for b in range(batch):
            row = int(lens[b])
            if page_size is None:
                c = int(kwargs["cache_batch_idx"][b]) if "cache_batch_idx" in kwargs else b
                got_k = k_cache[c, row:row + n_new]
            else:
                got_k = torch.stack([k_cache[table[b, r // page_size], r % page_size]
                                     for r in range(row, row + n_new)])
            c_ref = int(cpu["cache_batch_idx"][b]) if "cache_batch_idx" in cpu else b
            check(f"k_cache[{b}]", got_k.cpu(), ref_k[c_ref, row:row + n_new],
                  lowp_k[c_ref, row:row + n_new], atol=2e-2)  # the references wrote them


def paged_like(table, page_size, dense):
    batch, cap = dense.shape[:2]
    per_seq = table.shape[1]
    padded = dense.new_zeros(batch, per_seq * page_size, *dense.shape[2:])
    padded[:, :cap] = dense
    pages = dense.new_empty(table.numel(), page_size, *dense.shape[2:])
    pages[table.flatten().long()] = padded.view(-1, page_size, *dense.shape[2:])
    return pages


def _float_rotary(cpu):
    return {key: cpu[key].float() for key in ("rotary_cos", "rotary_sin") if key in cpu}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_dense(dtype, d, num_splits):
    run_case(dtype, d, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES[:1])
@pytest.mark.parametrize("page_size", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_decode_paged(dtype, page_size, num_splits):
    run_case(dtype, HEAD_DIMS[0] if HEAD_DIMS else 64, page_size=page_size,
             num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES[:1])
@pytest.mark.parametrize("case", [
    dict(rotary="interleaved"), dict(rotary="half"), dict(n_new=0), dict(n_new=5, seqlen_q=5),
    dict(batch_idx=True), dict(leftpad=True), dict(varlen_q=True, seqlen_q=4),
    dict(causal=False), dict(window=(16, 0)), dict(window=(7, 3), causal=False),
    dict(heads=(4, 4)), dict(heads=(8, 1)), dict(seqlen_q=3, n_new=3, page_size=3),
    dict(rotary="half", page_size=16, num_splits=3, n_new=2, seqlen_q=2),
    # Pages with a left pad: key tiles across a page boundary (a row's page each), and tiles
    # inside one page at an offset (one lookup a tile).
    dict(leftpad=True, page_size=16), dict(leftpad=(16, 0, 48), page_size=64),
    dict(leftpad=(16, 0, 48), page_size=64, num_splits=3, lengths=(40, 200, 290)),
    # Decode over caches whose rows past each sequence's keys hold NaN: dense, pages of whole
    # key tiles (TMA key tiles on sm90, Note [TMA key tiles]: the block zeroes those V rows),
    # split, under cache_batch_idx and after a dense leftpad (a tile off the rows' grid).
    dict(poison_tail=True), dict(poison_tail=True, page_size=16, num_splits=3),
    dict(poison_tail=True, page_size=64, lengths=(1, 17, 113)),
    dict(poison_tail=True, batch_idx=True, heads=(8, 1)),
    dict(poison_tail=True, leftpad=(3, 0, 5), num_splits=3),
    # Chunked prefill: many query rows (the Hopper family's, where it runs).
    dict(seqlen_q=200, n_new=200, cap=600, poison_tail=True),
    dict(seqlen_q=130, n_new=0, causal=False, cap=600),
    dict(seqlen_q=256, n_new=256, rotary="interleaved", cap=600, heads=(8, 8)),
    dict(seqlen_q=160, n_new=160, cap=600, page_size=16),
    # Chunked prefill over pages, under cache_batch_idx, after leftpads, heads before rows,
    # windows, packed q (at the largest head dim: the Hopper family gathers all but the dense
    # and cache_batch_idx rows into dense rows first).
    dict(seqlen_q=160, n_new=160, cap=600, page_size=1, poison_tail=True),
    dict(seqlen_q=150, n_new=0, cap=600, page_size=3, causal=False),
    dict(seqlen_q=130, n_new=130, cap=600, batch_idx=True, poison_tail=True),
    dict(seqlen_q=140, n_new=140, cap=600, leftpad=(16, 0, 48), page_size=64, rotary="half"),
    dict(seqlen_q=136, n_new=136, cap=600, hnd=True, page_size=16, window=(64, 0)),
    dict(seqlen_q=144, n_new=144, cap=600, varlen_q=True, page_size=256, heads=(8, 1)),
    # Caches laid out heads before rows, dense and paged, with an append.
    dict(hnd=True, n_new=2, seqlen_q=2), dict(hnd=True, page_size=16, rotary="half"),
    # Rotary positions from rotary_seqlens, not the cache lengths.
    dict(rotary="interleaved", rotary_seqlens=True, n_new=2, seqlen_q=2),
    dict(rotary="half", rotary_seqlens=True, page_size=16, leftpad=True),
])
def test_semantics(dtype, case):
    run_case(dtype, HEAD_DIMS[-1] if HEAD_DIMS else 128, **case)


def _uncompiled_head_dims():
    """Multiples of 8 that no kernel is compiled for but a compiled bucket above serves."""
    if not HEAD_DIMS:
        return []
    free = [d for d in range(16, HEAD_DIMS[-1], 8) if d not in HEAD_DIMS]
    return sorted({free[0], free[len(free) // 2], free[-1]}) if free else []


@pytest.mark.parametrize("d", _uncompiled_head_dims())
@pytest.mark.parametrize("case", [dict(), dict(page_size=16, rotary="half", n_new=2,
                                                 seqlen_q=2),
                                  dict(seqlen_q=150, n_new=150, cap=600)])
def test_head_dims_between_buckets(d, case):
    """A head dim between the compiled ones runs in the bucket above it (padded), decode,
    paged with an append and rotary, and a longer query."""
    run_case(DTYPES[0], d, **case)


@pytest.mark.parametrize("dtype", DTYPES[:1])
def test_one_split_combine_is_exact(dtype):
    """num_splits=1 and a forced split count that leaves all but one split empty agree."""
    run_case(dtype, HEAD_DIMS[0] if HEAD_DIMS else 64, lengths=(5, 9, 12), num_splits=1)
    run_case(dtype, HEAD_DIMS[0] if HEAD_DIMS else 64, lengths=(5, 9, 12), num_splits=3)


def test_scheduler_metadata_takes_the_ops_window_rule():
    """A left window longer than every key is no window, for the op and for the schedule it
    reports: with GQA 32/2 a decode step packs 16 query heads either way."""
    from flash_cuda import get_scheduler_metadata
    if not DTYPES:
        pytest.skip("no CUDA kernels in this build")
    lens = torch.full((2,), 4000, dtype=torch.int32, device="cuda")
    counts = {w: get_scheduler_metadata(2, 1, 4096, 32, 2, HEAD_DIMS[0], lens, qkv_dtype=DTYPES[0],
                                        window_size=(w, -1)).numel()
              for w in (-1, 10 ** 6)}
    assert counts[-1] == counts[10 ** 6], counts


def captured(step):
    """A CUDA graph of step(), run once outside the capture first (the warm-up)."""
    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def test_cuda_graph_replays_with_new_lengths():
    from flash_cuda import flash_attn_with_kvcache, get_scheduler_metadata
    if not DTYPES:
        pytest.skip("no CUDA kernels in this build")
    dtype, d = DTYPES[0], HEAD_DIMS[0]
    q = torch.randn(2, 1, 8, d, device="cuda", dtype=dtype)
    k_cache = torch.randn(2, 512, 2, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([10, 100], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    meta = get_scheduler_metadata(2, 1, 512, 8, 2, d, lens, qkv_dtype=dtype)
    assert meta.shape[0] > 1, "a 2-sequence decode step should be split on this GPU"

    def step():
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, out=out,
                                scheduler_metadata=meta)

    graph = captured(step)
    for new in ([37, 400], [1, 511]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
        torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_cuda_graph_paged_append_rotary():
    """A decode step that appends a rotated key to a paged cache, captured and replayed with new
    lengths: each replay writes the cache rows and gives the output an eager call gives on the
    cache as it was before it."""
    from flash_cuda import flash_attn_with_kvcache, get_scheduler_metadata
    if not DTYPES:
        pytest.skip("no CUDA kernels in this build")
    dtype, d, page = DTYPES[0], HEAD_DIMS[-1], 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    q, k, v = randn(2, 1, 8, d), randn(2, 1, 2, d), randn(2, 1, 2, d)
    k_cache, v_cache = randn(2 * 32, page, 2, d), randn(2 * 32, page, 2, d)
    table = torch.randperm(64, device="cuda", generator=gen).to(torch.int32).view(2, 32)
    angles = torch.rand(600, 16, device="cuda", generator=gen) * 6.28
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    lens = torch.tensor([10, 100], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    meta = get_scheduler_metadata(2, 1, 512, 8, 2, d, lens, qkv_dtype=dtype, page_size=page)
    args = dict(rotary_cos=cos, rotary_sin=sin, causal=True, page_table=table)

    def step():
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, out=out,
                                scheduler_metadata=meta, **args)

    graph = captured(step)
    for new in ([37, 400], [0, 511]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        before = k_cache.clone(), v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        want = flash_attn_with_kvcache(q, *before, k, v, cache_seqlens=lens, **args)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(k_cache, before[0], atol=0, rtol=0)  # the same rows written
        torch.testing.assert_close(v_cache, before[1], atol=0, rtol=0)


def _queued_steps(dtype, d, seed=1):
    """Eight decode steps over one long cache (one KV head: many splits), each with its own
    queries, appended key and lengths: their outputs queued without a sync between the steps,
    and the same steps run one at a time."""
    from flash_cuda import flash_attn_with_kvcache
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    k_cache, v_cache = randn(2, 16384, 1, d), randn(2, 16384, 1, d)
    steps = [(randn(2, 1, 8, d), randn(2, 1, 1, d), randn(2, 1, 1, d),
              torch.tensor([16000 - 7 * i, 9000 + i], dtype=torch.int32, device="cuda"))
             for i in range(8)]

    def run(sync):
        caches, outs = (k_cache.clone(), v_cache.clone()), []
        for q, k, v, lens in steps:
            outs.append(flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens))
            if sync:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return outs, caches
    return run(True), run(False)


def test_queued_steps_combine_their_own_partials():
    """Steps queued back to back give the bits of steps run one at a time: each combine reads
    its own step's partials, which sit where the step before left its own (the combine and the
    attention kernel start while the kernel before them finishes: Note [Overlapped launches],
    csrc/sm80/launch_fwd_kvcache.cuh)."""
    if not DTYPES:
        pytest.skip("no CUDA kernels in this build")
    (alone, caches_alone), (queued, caches_queued) = _queued_steps(DTYPES[0], HEAD_DIMS[-1])
    assert not torch.equal(alone[0], alone[1])  # the steps differ, so a stale read would show
    for i, (a, b) in enumerate(zip(alone, queued)):
        assert torch.equal(a, b), f"step {i}: queued output differs from the step run alone"
    for a, b in zip(caches_alone, caches_queued):
        assert torch.equal(a, b)


def test_plain_launches_give_the_same_bits(tmp_path):
    """FLASH_CUDA_NO_OVERLAP=1 launches the decode kernels plainly: the same outputs, bit for
    bit (a process of its own for each setting)."""
    if not DTYPES:
        pytest.skip("no CUDA kernels in this build")
    script = (
        "import sys, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_kvcache_cuda import _queued_steps, DTYPES, HEAD_DIMS\n"
        "(alone, _), (queued, _) = _queued_steps(DTYPES[0], HEAD_DIMS[-1])\n"
        "torch.save([t.cpu() for t in alone + queued], sys.argv[1])\n")
    outs = {}
    for flag in ("0", "1"):
        path = tmp_path / f"overlap_{flag}.pt"
        env = dict(os.environ, FLASH_CUDA_NO_OVERLAP=flag)
        subprocess.run([sys.executable, "-c", script, str(path), os.path.dirname(__file__)],
                       env=env, check=True, timeout=300)
        outs[flag] = torch.load(path)
    for i, (a, b) in enumerate(zip(outs["0"], outs["1"])):
        assert torch.equal(a, b), f"output {i} differs between overlapped and plain launches"


@pytest.mark.parametrize("seqlen_q", [1, 200])
@pytest.mark.parametrize("table", ["q dtype", "rows apart", "float64", "strided last dim"])
def test_rotary_tables_of_any_dtype_and_row_stride_give_the_float32_result(table, seqlen_q):
    """The kernels read float32 and q-dtype rotary tables in place, rows at any stride, and
    convert other tables first: each gives, bit for bit, what the same angles as a contiguous
    float32 table give (out and the appended rows), on a decode step and a chunked prefill."""
    from flash_cuda import flash_attn_with_kvcache
    if not DTYPES:
        pytest.skip("no KV-cache kernels built")
    dtype, d = DTYPES[0], HEAD_DIMS[-1]
    gen = torch.Generator(device="cuda").manual_seed(3)
    half = min(d, 64) // 2
    angles = torch.rand(1100, half, device="cuda", generator=gen) * 6.28
    own = {"cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype)}
    if table == "q dtype":
        tables = own
    elif table == "rows apart":  # the table's left half; its right half NaN, never to be read
        tables = {}
        for name, t in own.items():
            wide = poison(t.new_empty(t.shape[0], 2 * half))
            wide[:, :half] = t
            tables[name] = wide[:, :half]
    elif table == "float64":
        tables = {name: t.double() for name, t in own.items()}
    else:
        tables = {name: t.repeat_interleave(2, dim=1)[:, ::2] for name, t in own.items()}
    q = torch.randn(2, seqlen_q, 8, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(2, seqlen_q, 2, d, device="cuda", dtype=dtype, generator=gen)
            for _ in range(2))
    caches = [torch.randn(2, 1024, 2, d, device="cuda", dtype=dtype, generator=gen)
              for _ in range(2)]
    lens = torch.tensor([100, 700], dtype=torch.int32, device="cuda")
    results = []
    for tabs in ({name: t.float() for name, t in own.items()}, tables):
        k_cache, v_cache = (c.clone() for c in caches)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=tabs["cos"],
                                      rotary_sin=tabs["sin"], cache_seqlens=lens, causal=True,
                                      rotary_interleaved=False)
        results.append((out, k_cache, v_cache))
    for want, got in zip(*results):
        assert not torch.isnan(got).any()
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_op_refuses_a_head_dim_that_is_not_whole_16_byte_rows():
    """The op's CUDA kernel (C++ checks only) refuses a head dim of 4 (half a 16-byte row)
    instead of copying past the row."""
    k_cache = torch.randn(1, 64, 2, 8, device="cuda", dtype=torch.bfloat16)[..., :4]
    v_cache = torch.randn(1, 64, 2, 8, device="cuda", dtype=torch.bfloat16)[..., :4]
    q = torch.randn(1, 1, 2, 4, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.tensor([10], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="multiple of 8"):
        torch.ops.flash_cuda.fwd_kvcache(
            q, k_cache, v_cache, None, None, None, None, lens, None, None, None, None, None,
            None, None, 0.5, False, -1, -1, True, 0, out)


@pytest.mark.parametrize("case", [
    dict(page_size=128), dict(page_size=256, varlen_q=True), dict(page_size=256, n_new=0,
                                                                  causal=False),
    dict(page_size=128, window=(100, 0), heads=(8, 1)), dict(batch_idx=True, rotary="half"),
    dict(page_size=256, hnd=True, rotary="interleaved"),
])
@pytest.mark.parametrize("d", [d for d in (64, 96, 128) if d in HEAD_DIMS] or HEAD_DIMS[:1])
def test_prefill_reads_the_cache_in_place(case, d):
    """Chunked prefill at the head dims of 128-key tiles (64, 96, 128) over pages of whole key
    tiles and under cache_batch_idx, which the Hopper family reads in place (no gather), with
    NaN in every cache row past a sequence's keys."""
    run_case(DTYPES[0], d, **{"seqlen_q": 160, "n_new": 160, "cap": 600, "poison_tail": True,
                              **case})


def _hopper_kvcache():
    """Whether a chunked prefill runs on the Hopper family here (none of the knobs that send it
    elsewhere is set)."""
    import flash_cuda
    info = flash_cuda.build_info()
    return torch.cuda.get_device_capability() == (9, 0) and "fwd_kvcache" in \
        info["family_info"].get("sm90", {}).get("ops", []) and \
        os.environ.get("FLASH_CUDA_FAMILY", "sm90") in ("", "sm90") and \
        not os.environ.get("FLASH_CUDA_SMEM_LIMIT_KB")


def test_families_take_their_problems():
    """On a Hopper GPU with the sm90 family built, a chunked prefill over a dense cache runs its
    forward kernel, over small pages gathers the keys for it and over pages of whole key tiles
    reads them in place; a decode step runs the portable family's split kernel."""
    from flash_cuda import flash_attn_with_kvcache
    if not _hopper_kvcache():
        pytest.skip("needs an sm90 GPU and the sm90 family's KV-cache units")
    dtype, d = DTYPES[0], HEAD_DIMS[-1]
    k_cache = torch.randn(2, 1024, 2, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([100, 700], dtype=torch.int32, device="cuda")

    def kernels(seqlen_q):
        q = torch.randn(2, seqlen_q, 8, d, device="cuda", dtype=dtype)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True)
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    assert "sm90::fwd_kernel" in kernels(256)
    names = kernels(1)
    assert "sm80" in names and "combine" in names
    # Paged keys: gathered into dense rows, then the same forward.
    pages, table = paged(k_cache, 16, torch.Generator().manual_seed(0))
    q = torch.randn(2, 256, 8, d, device="cuda", dtype=dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        flash_attn_with_kvcache(q, pages, paged_like(table, 16, v_cache), cache_seqlens=lens,
                                page_table=table, causal=True)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "gather_kv" in names and "sm90::fwd_kernel" in names
    # Pages of whole key tiles at head dim 128 (a 128-key tile): read in place, no gather.
    if 128 in HEAD_DIMS:
        k128 = torch.randn(2, 1024, 2, 128, device="cuda", dtype=dtype)
        pages, table = paged(k128, 256, torch.Generator().manual_seed(0))
        q = torch.randn(2, 256, 8, 128, device="cuda", dtype=dtype)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            flash_attn_with_kvcache(q, pages, paged_like(table, 256, k128), cache_seqlens=lens,
                                    page_table=table, causal=True)
            torch.cuda.synchronize()
        names = " ".join(e.name for e in prof.events())
        assert "gather_kv" not in names and "CacheKeysConfig" in names


def test_decode_takes_tma_key_tiles_where_it_can():
    """On an sm90 GPU running the portable family's sm_90 code, a decode step at a head dim of
    whole 64-column blocks loads its key tiles by TMA over a dense cache and over pages of whole
    key tiles, and by cp.async over pages of 1 and over pages after a leftpad."""
    from flash_cuda import build_info, flash_attn_with_kvcache
    tma_dims = [d for d in HEAD_DIMS if d % 64 == 0]
    targets = build_info().get("family_info", {}).get("sm80", {}).get("targets", [])
    if (not tma_dims or torch.cuda.get_device_capability()[0] != 9 or "sm_90" not in targets
            or os.environ.get("FLASH_CUDA_NO_TMA_DECODE") == "1"
            or os.environ.get("FLASH_CUDA_FAMILY", "") not in ("", "sm80")):
        pytest.skip("needs an sm90 GPU, the portable family's sm_90 code and a head dim of "
                    "whole 64-column blocks")
    dtype, d = DTYPES[0], tma_dims[-1]
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(2, 512, 2, d, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lens = torch.tensor([100, 500], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 8, d, device="cuda", dtype=dtype)

    def kernels(page_size=None, **kwargs):
        k, v, extra = k_cache, v_cache, {}
        if page_size is not None:
            k, table = paged(k_cache, page_size, gen)
            v, extra = paged_like(table, page_size, v_cache), {"page_table": table}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, **extra, **kwargs)
            torch.cuda.synchronize()
        return " ".join(e.name for e in prof.events())

    assert "fwd_kvcache_tma_kernel" in kernels()
    assert "fwd_kvcache_tma_kernel" in kernels(16)
    assert "fwd_kvcache_tma_kernel" not in kernels(1)
    pads = torch.tensor([3, 0], dtype=torch.int32, device="cuda")
    assert "fwd_kvcache_tma_kernel" not in kernels(16, cache_leftpad=pads)


def test_prefill_over_a_page_table_wider_than_one_gather():
    """A page table of many unused columns (as servers size them, for the longest sequence)
    makes each sequence's gathered keys too large for one gather of the whole batch: the Hopper
    family then gathers and runs a sequence at a time (its query tiles fill the GPU), bitwise
    equal to the narrow table's call; a table wider still goes to the portable family, still
    exact."""
    from flash_cuda import flash_attn_with_kvcache
    dtype, d = DTYPES[0], HEAD_DIMS[-1]
    gen = torch.Generator().manual_seed(3)
    batch, cap, page = 3, 512, 64  # smaller than a key tile: gathered at every head dim
    k_cache = torch.randn(batch, cap, 2, d, generator=gen).to("cuda", dtype)
    v_cache = torch.randn(batch, cap, 2, d, generator=gen).to("cuda", dtype)
    pages, table = paged(k_cache, page, gen)
    v_pages = paged_like(table, page, v_cache)
    # 9 query tiles of 128 rows x 16 heads a sequence: over half of any Hopper GPU's SMs.
    q = torch.randn(batch, 1100, 16, d, generator=gen).to("cuda", dtype)
    lens = torch.tensor([0, 300, 512], dtype=torch.int32, device="cuda")

    def run(columns):
        wide = torch.zeros(batch, columns, dtype=torch.int32, device="cuda")  # unused: page 0
        wide[:, :table.shape[1]] = table
        out = poison(torch.empty_like(q))
        got, lse = flash_attn_with_kvcache(q, pages, v_pages, cache_seqlens=lens, page_table=wide,
                                           causal=True, out=out, return_softmax_lse=True)
        torch.cuda.synchronize()
        return got, lse

    narrow = run(table.shape[1])

    def close(got):
        assert not torch.isnan(got[0]).any()
        assert (got[0].float() - narrow[0].float()).abs().max().item() < 2e-2
        assert max_err(got[1], narrow[1]) < 1e-3  # -inf where a row sees no key, in both

    # A sequence's gathered K and V, 2 x rows x 2 heads x d x 2 bytes, just over 2^27 bytes:
    # over half of the 256 MiB a gather holds, so one sequence a gather; 4x that, over all of it.
    rows_one_seq = (1 << 27) // (8 * d) + 1
    chunked = run(-(-rows_one_seq // page))
    if _hopper_kvcache():  # the same forward over the same gathered rows
        assert torch.equal(chunked[0], narrow[0]) and torch.equal(chunked[1], narrow[1])
    else:  # the portable family: a split count of its own for each table width
        close(chunked)
    close(run(-(-4 * rows_one_seq // page)))
