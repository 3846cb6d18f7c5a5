"""Attention under torch's context parallel (ring attention over the GPUs of one host): forward +
backward time per step and peak memory per GPU, flash_cuda as SDPA's flash implementation next
to SDPA's cuDNN backend under the same context parallel, with the strong-scaling efficiency
against a one-GPU run of the same script.

Each point is a whole sequence of `seqlen` tokens (batch 1, causal by default) sharded over the
ranks by `context_parallel` (head-tail load balance for causal); one step is SDPA forward and
backward on every rank, timed between CUDA events and taken as the slowest rank's median.
Backends run in turns within a point, so they share one power state. Peak memory is
torch.cuda.max_memory_allocated over the point's steps, the largest rank's.

Run (NVLink multicast off, as the host requires):
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 1 benchmarks/bench_context_parallel.py \
        --json cp1.json
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_context_parallel.py \\
        --baseline cp1.json --json cp2.json --plot cp2.png
Efficiency at N GPUs = t(1 GPU) / (N x t(N GPUs)) for the same point and backend.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BACKENDS = ("flash_cuda", "sdpa_cudnn")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _int_list(text):
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlens", type=_int_list, default=[131072, 262144, 524288])
    parser.add_argument("--heads", default="32/8", help="query / key-value heads")
    parser.add_argument("--hdim", type=int, default=128, choices=(64, 128, 256))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per backend and point")
    parser.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather")
    parser.add_argument("--baseline", metavar="JSON", help="a one-GPU run, for the efficiency")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH")
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        parser.error(f"--backends: choose among {', '.join(BACKENDS)}; got {args.backends}")
    q, _, kv = args.heads.partition("/")
    args.heads_q, args.heads_kv = int(q), int(kv or q)
    if args.heads_kv <= 0 or args.heads_q % args.heads_kv:
        parser.error(f"--heads: the query heads must be a multiple of the key-value heads; got "
                     f"{args.heads}")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def _backend_context(name):
    """(enter, exit) of a backend: the SDPA backend to pin and the flash implementation."""
    from torch.nn.attention import (SDPBackend, activate_flash_attention_impl,
                                    restore_flash_attention_impl)
    if name == "flash_cuda":
        return SDPBackend.FLASH_ATTENTION, lambda: activate_flash_attention_impl("flash_cuda"), \
            restore_flash_attention_impl
    return SDPBackend.CUDNN_ATTENTION, lambda: None, lambda: None


def time_point(mesh, args, seqlen, names):
    """{backend: (median ms of the slowest rank, peak bytes of the largest rank)} of one point;
    a backend that fails records its error instead."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import sdpa_kernel

    dtype = DTYPES[args.dtype]
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (1, args.heads_q, seqlen, args.hdim)
    shape_kv = (1, args.heads_kv, seqlen, args.hdim)
    q = torch.randn(shape_q, generator=g, device="cuda", dtype=dtype)
    k, v = (torch.randn(shape_kv, generator=g, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn(shape_q, generator=g, device="cuda", dtype=dtype)
    samples = {n: [] for n in names}
    peaks = {n: 0 for n in names}
    errors = {}
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2],
                          no_restore_buffers={q, k, v, dout}):
        # The shards keep the whole sequence's storage (resize_ shrinks the view only): give
        # each its own, so that the peak memory is a rank's.
        for t in (q, k, v, dout):
            t.set_(t.clone())
        torch.cuda.empty_cache()
        for turn in range(args.steps + 1):  # the first turn warms up
            for name in names if turn % 2 == 0 else list(reversed(names)):
                if name in errors:
                    continue
                backend, enter, leave = _backend_context(name)
                qs = ks = vs = out = None
                enter()
                try:
                    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
                    torch.cuda.reset_peak_memory_stats()
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    with sdpa_kernel(backend):
                        start.record()
                        out = F.scaled_dot_product_attention(
                            qs, ks, vs, is_causal=args.causal,
                            enable_gqa=args.heads_q != args.heads_kv)
                        out.backward(dout)
                        end.record()
                    torch.cuda.synchronize()
                    if turn > 0:
                        samples[name].append(start.elapsed_time(end))
                        peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
                except Exception as exc:  # a backend's failure is data, not a crash
                    errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                finally:
                    leave()
                    del qs, ks, vs, out
                # Every rank learns of a failure anywhere before the next ring, which would
                # otherwise wait for the rank that stopped.
                failed = torch.tensor([1.0 if name in errors else 0.0], device="cuda")
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
                if failed.item() and name not in errors:
                    errors[name] = "failed on another rank"
                    samples[name].clear()
    results = {}
    for name in names:
        if name in errors:
            results[name] = {"error": errors[name]}
            continue
        stats = torch.tensor([statistics.median(samples[name]), float(peaks[name])],
                             device="cuda", dtype=torch.float64)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        results[name] = {"ms": stats[0].item(), "peak_gib": stats[1].item() / 2**30}
    return results


def attention_flops(seqlen, heads_q, hdim, causal):
    """Forward + backward FLOPs of the whole sequence (backward 2.5x the forward)."""
    fwd = 4 * seqlen * seqlen * heads_q * hdim * (0.5 if causal else 1.0)
    return 3.5 * fwd


def table(rows, names, world, baseline):
    head = ["tokens"] + [f"{n} ms" for n in names] + [f"{n} GiB" for n in names]
    head += ["flash_cuda speed / sdpa_cudnn"]
    if baseline:
        head += [f"{n} efficiency" for n in names]
    lines = [" | ".join(head), "-" * (12 * len(head))]
    for row in rows:
        r = row["results"]
        cells = [f"{row['seqlen'] // 1024}k"]
        cells += [f"{r[n]['ms']:.1f}" if "ms" in r.get(n, {}) else "-" for n in names]
        cells += [f"{r[n]['peak_gib']:.1f}" if "ms" in r.get(n, {}) else "-" for n in names]
        ok = all("ms" in r.get(n, {}) for n in ("flash_cuda", "sdpa_cudnn"))
        cells.append(f"{r['sdpa_cudnn']['ms'] / r['flash_cuda']['ms']:.3f}x" if ok else "-")
        if baseline:
            cells += [f"{row['efficiency'][n]:.2f}" if row["efficiency"].get(n) else "-"
                      for n in names]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


SAME_PROBLEM = ("heads_q", "heads_kv", "hdim", "dtype", "causal")


def efficiency(rows, world, baseline_path, config=None):
    """Adds each row's efficiency against the one-GPU run in baseline_path (whose problem,
    SAME_PROBLEM of its config, must be this run's)."""
    if not baseline_path:
        return
    with open(baseline_path) as f:
        payload = json.load(f)
    if config is not None:
        theirs = payload.get("config", {})
        differ = [k for k in SAME_PROBLEM if theirs.get(k) != config.get(k)]
        if differ:
            raise SystemExit(f"--baseline {baseline_path} times another problem "
                             f"({', '.join(differ)} differ)")
    base = {r["seqlen"]: r["results"] for r in payload["results"]}
    for row in rows:
        row["efficiency"] = {}
        for name, res in row["results"].items():
            one = base.get(row["seqlen"], {}).get(name, {})
            if "ms" in res and "ms" in one:
                row["efficiency"][name] = one["ms"] / (world * res["ms"])


def write_plot(path, rows, names, world):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        pts = [(r["seqlen"], r["results"][name]["ms"]) for r in rows if "ms" in r["results"][name]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens (whole sequence)")
    ax.set_ylabel(f"ms per forward + backward ({world} GPUs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    args = parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    import bench_attn
    import flash_cuda  # noqa: F401  (registers "flash_cuda" as a flash-attention implementation)

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cuda", (world,))
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
    efficiency([], world, args.baseline, config)  # a baseline of another problem stops here
    set_rotate_method(args.rotate)
    # torch balances causal shards head-tail and refuses the balance without a causal mask.
    _cp_options.enable_load_balance = args.causal
    rows = []
    for seqlen in args.seqlens:
        chunks = 2 * world if args.causal else world
        if seqlen % chunks:
            if rank == 0:
                print(f"skip {seqlen}: context parallel shards it into {chunks} equal chunks")
            continue
        results = time_point(mesh, args, seqlen, args.backends)
        flops = attention_flops(seqlen, args.heads_q, args.hdim, args.causal)
        for res in results.values():
            if "ms" in res:
                res["tflops_per_gpu"] = flops / (res["ms"] * 1e9) / world
        rows.append({"seqlen": seqlen, "results": results})
        if rank == 0:
            print(f"{seqlen // 1024}k: " + "; ".join(
                f"{n} " + (f"{r['ms']:.1f} ms {r['peak_gib']:.1f} GiB" if "ms" in r
                           else r["error"]) for n, r in results.items()), flush=True)
    if rank == 0:
        efficiency(rows, world, args.baseline, config)
        print(table(rows, args.backends, world, args.baseline))
        if args.json:
            payload = {"environment": dict(bench_attn.environment(), world_size=world),
                       "config": config,
                       "results": rows}
            with open(args.json, "w") as f:
                json.dump(payload, f, indent=2)
            print(f"wrote {args.json}")
        if args.plot:
            write_plot(args.plot, rows, args.backends, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
