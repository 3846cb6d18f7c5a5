"""A small set of forward and backward calls for compute-sanitizer, one per kind of tile the
kernels run (dense, causal, window, GQA, varlen with an empty sequence, padded head dim), for
every kernel family the GPU runs.  Not collected by pytest (no test_ prefix); run as

    for tool in memcheck racecheck synccheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python tests/sanitize.py || echo $tool failed
    done

and expect "ERROR SUMMARY: 0 errors" from each tool.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import kernel_families  # noqa: E402
from flash_cuda import flash_attn_func, flash_attn_varlen_func  # noqa: E402


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
    yield "backward", lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True).sum(),
                                                  (q, k, v))


def main():
    families = kernel_families()
    assert families, "no kernel family runs on this GPU: nothing would be checked"
    os.environ["FLASH_CUDA_FAMILY_STRICT"] = "1"  # a [sm90] call must run sm90's kernel
    for family in families:
        os.environ["FLASH_CUDA_FAMILY"] = family
        for name, call in calls():
            call()
            torch.cuda.synchronize()
            print(f"{family} {name}: ok", flush=True)


if __name__ == "__main__":
    main()
