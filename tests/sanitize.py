"""A small set of forward and backward calls for compute-sanitizer, one per kind of tile the
kernels run (dense, causal, window, GQA, varlen with an empty sequence, more tiles than SMs,
padded head dim), for every kernel family the GPU runs, and the KV-cache paths (decode over
dense and paged caches, split or not, append with rotary, a longer query, chunked prefill).
Not collected by pytest (no test_ prefix); run as

    for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python tests/sanitize.py || echo $tool failed
    done

and expect "ERROR SUMMARY: 0 errors" from each tool.  An argument keeps only the calls whose
name contains it (`python tests/sanitize.py "hdim 256"`).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import kernel_families  # noqa: E402
from flash_cuda import flash_attn_func, flash_attn_varlen_func  # noqa: E402
from flash_cuda import flash_attn_with_kvcache  # noqa: E402


def calls():
    import flash_cuda
    info = flash_cuda.build_info()
    dtypes = info["dtypes"]
    dims = sorted(info["head_dims"]["fwd"])
    dt = torch.bfloat16 if "bf16" in dtypes else torch.float16
    dt_other = torch.float16 if "fp16" in dtypes else dt
    d = dims[-1] if dims[-1] < 128 else 128
    q = torch.randn(1, 200, 4, d, device="cuda", dtype=dt, requires_grad=True)
    k, v = (torch.randn(1, 300, 2, d, device="cuda", dtype=dt, requires_grad=True)
            for _ in range(2))
    yield "dense gqa", lambda: flash_attn_func(q, k, v)
    yield "causal", lambda: flash_attn_func(q, k, v, causal=True)
    yield "window", lambda: flash_attn_func(q, k, v, window_size=(33, 7))
    for dd in sorted({dims[0], 72, dims[-1]}):
        if dd > dims[-1]:
            continue
        qd = torch.randn(1, 130, 2, dd, device="cuda", dtype=dt_other)
        yield f"hdim {dd}", lambda qd=qd: flash_attn_func(qd, qd, qd, causal=True)
    lens = [100, 0, 257, 1]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    qv = torch.randn(sum(lens), 4, d, device="cuda", dtype=dt)
    kv = torch.randn(sum(lens), 2, d, device="cuda", dtype=dt)
    yield "varlen", lambda: flash_attn_varlen_func(qv, kv, kv, cu, cu, 257, 257, causal=True)
    # More query tiles than SMs (about 300): persistent blocks take several tiles in turn.
    lens_q, lens_k = [300, 0, 129, 700, 17] * 4, [200, 5, 0, 700, 300] * 4
    cu_q = torch.tensor([0] + lens_q, device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lens_k, device="cuda").cumsum(0).to(torch.int32)
    qm = torch.randn(sum(lens_q), 8, d, device="cuda", dtype=dt)
    km = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=dt)
    yield "many tiles", lambda: flash_attn_varlen_func(qm, km, km, cu_q, cu_k, 700, 700,
                                                       causal=True)
    yield "backward", lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True).sum(),
                                                  (q, k, v))
    # Head dim 256 over many tiles per block: the Hopper kernel stages O in V's stages there.
    if 256 in dims:
        q256 = torch.randn(40, 129, 4, 256, device="cuda", dtype=dt)
        k256 = torch.randn(40, 129, 2, 256, device="cuda", dtype=dt)
        yield "hdim 256 many tiles", lambda: flash_attn_func(q256, k256, k256, causal=True)
        qp = torch.randn(sum(lens_q), 8, 256, device="cuda", dtype=dt)
        kp = torch.randn(sum(lens_k), 2, 256, device="cuda", dtype=dt)
        yield "hdim 256 varlen many tiles", lambda: flash_attn_varlen_func(
            qp, kp, kp, cu_q, cu_k, 700, 700, causal=True)
        # No mask, 3 query tiles per head, more tiles than SMs (the persistent blocks take
        # several, all of equal work).
        qc = torch.randn(12, 300, 4, 256, device="cuda", dtype=dt)
        kc = torch.randn(12, 200, 2, 256, device="cuda", dtype=dt)
        yield "hdim 256 dense many tiles", lambda: flash_attn_func(qc, kc, kc)


def reversed_pages(caches, page):
    """(table, paged caches): dense (batch, rows, heads, d) caches in pages of `page` rows,
    handed out in reverse order (the last rows of a partial page repeat the first ones)."""
    batch, rows = caches[0].shape[:2]
    per_seq = -(-rows // page)
    table = torch.arange(batch * per_seq, dtype=torch.int32, device="cuda").flip(0)
    table = table.view(batch, per_seq)
    order = table.flatten().long().argsort()
    return table, [torch.cat([t, t[:, :per_seq * page - rows]], 1)
                   .view(batch * per_seq, page, *t.shape[2:])[order].contiguous()
                   for t in caches]


def kvcache_calls(dt, d):
    """Decode steps (one query row, GQA 4/1: packed) over a dense and a paged cache (pages of 3
    and of 16, in reverse order) with lengths 0, 17 and 290, unsplit, split 3 ways and by the
    heuristic; an append of 2 keys with rotary; 5 query rows (unpacked); 200 rows (chunked
    prefill over a dense cache, over pages of 3 and of 256, and under cache_batch_idx)."""
    lens = torch.tensor([0, 17, 290], dtype=torch.int32, device="cuda")
    kc, vc = (torch.randn(3, 300, 1, d, device="cuda", dtype=dt) for _ in range(2))
    table, (kp, vp) = reversed_pages((kc, vc), 3)
    # Pages of 16: a key tile inside one page.
    table16, (k16, v16) = reversed_pages((kc, vc), 16)
    q1 = torch.randn(3, 1, 4, d, device="cuda", dtype=dt)
    for splits in (1, 3, 0):
        yield f"kvcache dense s{splits}", lambda s=splits: flash_attn_with_kvcache(
            q1, kc, vc, cache_seqlens=lens, causal=True, num_splits=s)
        yield f"kvcache paged s{splits}", lambda s=splits: flash_attn_with_kvcache(
            q1, kp, vp, cache_seqlens=lens, page_table=table, causal=True, num_splits=s)
        yield f"kvcache pages of 16 s{splits}", lambda s=splits: flash_attn_with_kvcache(
            q1, k16, v16, cache_seqlens=lens, page_table=table16, causal=True, num_splits=s)
    k_new, v_new = (torch.randn(3, 2, 1, d, device="cuda", dtype=dt) for _ in range(2))
    cos, sin = torch.randn(2, 400, 16, device="cuda", dtype=dt).unbind(0)
    q2 = torch.randn(3, 2, 4, d, device="cuda", dtype=dt)
    yield "kvcache append rotary", lambda: flash_attn_with_kvcache(
        q2, kp, vp, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
        page_table=table, causal=True)
    q5 = torch.randn(3, 5, 4, d, device="cuda", dtype=dt)
    yield "kvcache 5 rows", lambda: flash_attn_with_kvcache(q5, kc, vc, cache_seqlens=lens,
                                                            causal=True, num_splits=3)
    k200, v200 = (torch.randn(1, 200, 1, d, device="cuda", dtype=dt) for _ in range(2))
    kl, vl = (torch.randn(1, 600, 1, d, device="cuda", dtype=dt) for _ in range(2))
    q200 = torch.randn(1, 200, 4, d, device="cuda", dtype=dt)
    yield "kvcache prefill", lambda: flash_attn_with_kvcache(
        q200, kl, vl, k200, v200, cache_seqlens=300, causal=True)
    # Chunked prefill over pages of 3 (gathered into dense rows on the Hopper family).
    q200b = torch.randn(3, 200, 4, d, device="cuda", dtype=dt)
    yield "kvcache paged prefill", lambda: flash_attn_with_kvcache(
        q200b, kp, vp, cache_seqlens=lens, page_table=table, causal=True)
    # Pages of 256 rows (whole key tiles up to head dim 128): read in place on the Hopper family.
    table256, (k256, v256) = reversed_pages((kc, vc), 256)
    yield "kvcache paged prefill in place", lambda: flash_attn_with_kvcache(
        q200b, k256, v256, cache_seqlens=lens, page_table=table256, causal=True)
    # cache_batch_idx (rows 4, 0, 2 of 5): read in place on the Hopper family.
    kb, vb = (torch.randn(5, 300, 1, d, device="cuda", dtype=dt) for _ in range(2))
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    yield "kvcache batch_idx prefill", lambda: flash_attn_with_kvcache(
        q200b, kb, vb, cache_seqlens=lens, cache_batch_idx=idx, causal=True)


def main():
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    families = kernel_families()
    assert families, "no kernel family runs on this GPU: nothing would be checked"
    os.environ["FLASH_CUDA_FAMILY_STRICT"] = "1"  # a [sm90] call must run sm90's kernel
    for family in families:
        os.environ["FLASH_CUDA_FAMILY"] = family
        for name, call in calls():
            if only not in name:
                continue
            call()
            torch.cuda.synchronize()
            print(f"{family} {name}: ok", flush=True)
    # The KV-cache calls under the default choice, which hands each problem to the family
    # that takes it (decode to the portable family, a chunked prefill to the Hopper one).
    import flash_cuda
    info = flash_cuda.build_info()
    if info["features"].get("kvcache"):
        os.environ.pop("FLASH_CUDA_FAMILY", None)
        os.environ.pop("FLASH_CUDA_FAMILY_STRICT", None)
        dt = torch.bfloat16 if "bf16" in info["dtypes"] else torch.float16
        d = min(128, max(info["head_dims"]["fwd_kvcache"]))
        for name, call in kvcache_calls(dt, d):
            if only not in name:
                continue
            call()
            torch.cuda.synchronize()
            print(f"{name}: ok", flush=True)


if __name__ == "__main__":
    main()
