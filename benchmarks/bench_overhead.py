"""Host time per call of the Python API over the bare op (torch.ops.flash_cuda.fwd).

Decode-sized problems (one query token against a short cache) run in a few microseconds on the
GPU, so what the host spends per call shows in every step. This times, per call, the wall clock
of back-to-back calls of flash_attn_func / flash_attn_varlen_func and of the op they call with
the same arguments, in turns, on shapes small enough that the host, not the GPU, is the
bottleneck; the difference is the API's own cost (argument conversion and checks). Inference
mode (torch.no_grad), as decoding runs.

    python benchmarks/bench_overhead.py --device cuda --json overhead.json
"""

import argparse
import json
import statistics
import time

import torch

import flash_cuda
from flash_cuda import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


def _time_calls(fn, calls, sync):
    """Host time per call of `calls` back-to-back calls, starting on an idle GPU. The kernels
    (a few microseconds each at these shapes) queue up behind the calls, so the clock stops when
    the last call returns: host time, whatever the kernels take."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    sync()
    return elapsed


def interleaved_us(fns, device, calls, repeats):
    """Median host time per call of each function, timed in turns (fn 0, fn 1, ..., fn 0, ...)
    so that clock and cache drift touch all alike."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in fns:
        for _ in range(max(calls, 50)):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            times[i].append(_time_calls(fn, calls, sync))
    return [statistics.median(t) for t in times]


_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCUDA)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradMeta))


def _below_autograd(op, *args):
    with torch._C._ExcludeDispatchKeyGuard(_AUTOGRAD_KEYS):
        return op(*args)


def cases(device):
    """(name, API call, the op call it makes); one query token against 256 keys, 8 query heads
    on 2 kv heads, head dim 128: a decode step small enough that the host is the bottleneck."""
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    q = torch.randn(1, 1, 8, 128, device=device, dtype=dtype)
    k = torch.randn(1, 256, 2, 128, device=device, dtype=dtype)
    op = torch.ops.flash_cuda.fwd.default
    scale = 128 ** -0.5
    yield ("dense", lambda: flash_attn_func(q, k, k, causal=True),
           lambda: op(q, k, k, None, None, None, None, 1, 256, scale, True, -1, 0, False))
    # The op with its autograd kernel (a Python one, from torch.library.register_autograd)
    # skipped: what that layer costs, for the record.
    yield ("dense, op below autograd", None,
           lambda: _below_autograd(op, q, k, k, None, None, None, None, 1, 256, scale, True, -1,
                                   0, False))
    cu_q = torch.tensor([0, 1], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 256], dtype=torch.int32, device=device)
    qv, kv = q[0], k[0]
    yield ("varlen", lambda: flash_attn_varlen_func(qv, kv, kv, cu_q, cu_k, 1, 256,
                                                    causal=True),
           lambda: op(qv, kv, kv, cu_q, cu_k, None, None, 1, 256, scale, True, -1, 0, False))
    # A decode step over an 8k-row KV cache (lengths 8000), 8 query heads on 1: the API, the op
    # and, on CUDA, cuDNN's SDPA on the same problem in its own layout.
    kc = torch.randn(1, 8192, 1, 128, device=device, dtype=dtype)
    lens = torch.full((1,), 8000, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    args = (q, kc, kc, None, None, None, None, lens, None, None, None, None, None, None, None,
            scale, True, -1, 0, True, 0, out)
    yield ("kvcache decode", lambda: flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens,
                                                             causal=True, out=out),
           lambda: torch.ops.flash_cuda.fwd_kvcache.default(*args))
    if device == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
        qs, ks = q.transpose(1, 2), kc[:, :8000].transpose(1, 2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                scaled_dot_product_attention(qs, ks, ks, enable_gqa=True)

        yield ("decode, SDPA cuDNN (same problem)", None, cudnn)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "meta",
                        help="cuda, or meta (fake kernels: the host path without a GPU)")
    parser.add_argument("--calls", type=int, default=100, help="calls per timed turn")
    parser.add_argument("--repeats", type=int, default=101, help="turns per function")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    rows = []
    with torch.no_grad():
        for name, api, bare in cases(args.device):
            fns = [bare] if api is None else [api, bare]
            times = interleaved_us(fns, args.device, args.calls, args.repeats)
            api_us, bare_us = (None, times[0]) if api is None else times
            rows.append(dict(case=name, device=args.device, api_us=api_us, op_us=bare_us,
                             overhead_us=None if api_us is None else api_us - bare_us))
    info = dict(torch=torch.__version__, flash_cuda=flash_cuda.__version__,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                calls=args.calls, repeats=args.repeats, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    print(f"| case | device | API us/call | op us/call | API overhead us |")
    print(f"|---|---|---|---|---|")
    def show(x):
        return "-" if x is None else f"{x:.1f}"

    for r in rows:
        print(f"| {r['case']} | {r['device']} | {show(r['api_us'])} | {show(r['op_us'])} | "
              f"{show(r['overhead_us'])} |")


if __name__ == "__main__":
    main()
