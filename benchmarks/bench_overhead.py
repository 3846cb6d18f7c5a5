"""Host time per call of the Python API over the bare op (torch.ops.flash_cuda.fwd).

Decode-sized problems (one query token against a short cache) run in a few microseconds on the
GPU, so what the host spends per call shows in every step. This times, per call, the wall clock
of many back-to-back calls of flash_attn_func / flash_attn_varlen_func and of the op they call
with the same arguments, on shapes small enough that the host, not the GPU, is the bottleneck;
the difference is the API's own cost (argument conversion and checks). Inference mode
(torch.no_grad), as decoding runs.

    python benchmarks/bench_overhead.py --device cuda --json overhead.json
"""

import argparse
import json
import statistics
import time

import torch

import flash_cuda
from flash_cuda import flash_attn_func, flash_attn_varlen_func


def per_call_us(fn, device, calls, repeats):
    """Median over `repeats` of the host time of `calls` back-to-back calls, per call. The GPU
    is idle at the start of each repeat and the kernels queue up behind the calls (a few
    hundred launches stay far below the launch queue's depth), so the clock stops when the last
    call returns: host time, whatever the kernels take."""
    for _ in range(max(calls // 10, 50)):
        fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    sync()
    return statistics.median(times), min(times), max(times)


_AUTOGRAD_KEYS = (torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCUDA)
                  | torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradMeta))


def _below_autograd(op, *args):
    with torch._C._ExcludeDispatchKeyGuard(_AUTOGRAD_KEYS):
        return op(*args)


def cases(device):
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    q = torch.randn(1, 1, 32, 128, device=device, dtype=dtype)
    k = torch.randn(1, 256, 8, 128, device=device, dtype=dtype)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "meta",
                        help="cuda, or meta (fake kernels: the host path without a GPU)")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    rows = []
    with torch.no_grad():
        for name, api, bare in cases(args.device):
            # Interleave so that clock and cache state drift affects both alike.
            api_t, bare_t = [], []
            for _ in range(3):
                if api is not None:
                    api_t.append(per_call_us(api, args.device, args.calls, args.repeats))
                bare_t.append(per_call_us(bare, args.device, args.calls, args.repeats))
            api_us = statistics.median(t[0] for t in api_t) if api_t else None
            bare_us = statistics.median(t[0] for t in bare_t)
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
