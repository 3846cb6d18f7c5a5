"""Attention throughput of flash_cuda against its peers, forward and backward, on one GPU.

Every backend is timed in the same run on the same random inputs, so the ratios it reports
hold even on a shared machine whose absolute numbers move by a few percent. The grid is the
FlashAttention papers' one: 16384 tokens in total (batch = tokens // seqlen), model dim 2048
(heads = 2048 // head dim), seqlen 512..16384, head dim 64/128/256, causal and not.

Backends: flash_cuda; PyTorch SDPA pinned to one kernel each (sdpa_flash, sdpa_cudnn,
sdpa_efficient); FlashAttention where importable (fa3 = flash_attn_interface, fa4_cute =
flash_attn.cute, fa2 = flash_attn). A backend that cannot run a point records None and a note.

Timing (--timer): "interleaved" (the default) takes turns: every turn runs each backend once,
each call after the L2 is emptied and between its own CUDA events (the GPU held about 100 us
before the start event, so that a call shorter than its own launch is not timed as the host's
latency), and each backend's number is the median of its calls. All backends thus share one power regime, set by all of them: the
H200 idles at 345 MHz, runs into its 700 W power cap within a second of load and then sets its
clock by the power drawn, so a backend timed alone meets a state set by itself and by what
ran before it. In turns, a kernel that draws more power per clock than the others runs at a
higher clock than it would alone at the cap, and one that draws less at a lower one, as in a
training step, where the clock follows the whole mix of kernels (benchmarks/NOTES.md, entry
38: the same kernels' ratios moved by up to 5% between the two timers). "sequential" times
one backend after the other with
triton.testing.do_bench (CUDA events if triton is missing), each point starting with the next
backend in every round. The backward is timed alone: the forward runs once, then only
torch.autograd.grad is repeated. With --rounds N the whole grid runs N times and each number
is the median over the rounds: a point's rounds are a grid apart in time, so a transient
slowdown of the GPU (another tenant) moves one round, not the result.
FLOPs: forward 4 * batch * heads * seqlen^2 * hdim, halved when causal; backward 2.5x that.

Run:
    python benchmarks/bench_attn.py                      # the whole grid, bf16
    python benchmarks/bench_attn.py --hdims 128 --json out.json --plot out.png
    python benchmarks/bench_attn.py --seqlens 2048,8192 --causal yes --direction bwd
    python benchmarks/bench_attn.py --rounds 5 --json grid.json   # medians of 5 rounds
    python benchmarks/bench_attn.py --timer sequential             # do_bench, one backend at a time
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import platform
import statistics
import sys
from typing import Callable

import torch

FLASH_CUDA = "flash_cuda"
SDPA_FLASH = "sdpa_flash"
SDPA_CUDNN = "sdpa_cudnn"
ALL_BACKENDS = (FLASH_CUDA, SDPA_FLASH, SDPA_CUDNN, "sdpa_efficient", "fa3", "fa4_cute", "fa2")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Backward FLOPs over forward FLOPs: five matmuls (dV, dP, dS-to-dQ, dK, and the recomputed S)
# against the forward's two, the convention used by the FlashAttention papers.
BWD_FLOP_FACTOR = 2.5
# do_bench empties a buffer of this size between calls so that no call finds its inputs in L2;
# time_in_turns (the interleaved timer and the fallback without triton) does the same.
L2_FLUSH_BYTES = 256 * 1024 * 1024
# time_in_turns holds the GPU this many cycles (torch.cuda._sleep, about 100 us) after each
# flush, before the call's start event: the host then has the flush's time and this to queue
# the call's kernels, so a short call (a decode step: 10-20 us of kernels after 50-100 us of
# Python and launches) is timed as its kernels, not as the host's launch latency.  Without it,
# calls shorter than their launch read up to 6x slow for every backend on a machine whose CPU
# was slower (benchmarks/NOTES.md entry 90).
HOST_COVER_CYCLES = 200_000


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention implementation: how to lay out q, k, v for it and how to call it."""

    name: str
    # (q, k, v, causal) -> out, taking tensors in the layout `prepare` returns.
    forward: Callable
    # Layout change from (batch, seqlen, heads, hdim), done outside the timed region.
    prepare: Callable = lambda q, k, v: (q, k, v)
    # Entered around every forward call of this backend (SDPA kernel pinning); the backward
    # runs the kernels its forward recorded.
    context: Callable = contextlib.nullcontext


@dataclasses.dataclass(frozen=True)
class Point:
    """One grid point; `tflops` maps backend name to TFLOP/s or None where it did not run."""

    direction: str
    hdim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    tflops: dict
    rounds: list = dataclasses.field(default_factory=list)  # per round {name: TFLOP/s or None}


def attention_flops(batch, heads, seqlen, hdim, causal, direction):
    """FLOPs of one attention call: QK^T and PV at 2 * s^2 * d each per head, per batch."""
    flops = 4 * batch * heads * seqlen * seqlen * hdim
    if causal:
        flops /= 2
    if direction == "bwd":
        flops *= BWD_FLOP_FACTOR
    return flops


def _first(result):
    """Some FlashAttention versions return (out, lse); the benchmark needs only out."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _to_bhsd(q, k, v):
    """SDPA wants (batch, heads, seqlen, hdim); views keep the (b, s, h, d) memory order."""
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def _load_flash_cuda():
    from flash_cuda import flash_attn_func

    return Backend(FLASH_CUDA, lambda q, k, v, c: _first(flash_attn_func(q, k, v, causal=c)))


def _sdpa_loader(name, kernel_name):
    def load():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = torch.nn.functional.scaled_dot_product_attention
        kernel = getattr(SDPBackend, kernel_name)
        return Backend(name, lambda q, k, v, c: sdpa(q, k, v, is_causal=c),
                       prepare=_to_bhsd, context=lambda: sdpa_kernel([kernel]))

    return load


def _load_fa3():
    from flash_attn_interface import flash_attn_func

    return Backend("fa3", lambda q, k, v, c: _first(flash_attn_func(q, k, v, causal=c)))


def _load_fa4_cute():
    from flash_attn.cute import flash_attn_func

    return Backend("fa4_cute", lambda q, k, v, c: _first(flash_attn_func(q, k, v, causal=c)))


def _load_fa2():
    from flash_attn import flash_attn_func

    return Backend("fa2", lambda q, k, v, c: _first(flash_attn_func(q, k, v, causal=c)))


LOADERS = {
    FLASH_CUDA: _load_flash_cuda,
    SDPA_FLASH: _sdpa_loader(SDPA_FLASH, "FLASH_ATTENTION"),
    SDPA_CUDNN: _sdpa_loader(SDPA_CUDNN, "CUDNN_ATTENTION"),
    "sdpa_efficient": _sdpa_loader("sdpa_efficient", "EFFICIENT_ATTENTION"),
    "fa3": _load_fa3,
    "fa4_cute": _load_fa4_cute,
    "fa2": _load_fa2,
}


def load_backends(names, explicit, notes):
    """Imports each backend; returns {name: Backend or None} in the order asked for.

    flash_cuda, and any backend named on the command line, keeps a column of None when it
    cannot be imported, so the table shows it missing; an optional peer is simply dropped.
    """
    backends = {}
    for name in names:
        try:
            backends[name] = LOADERS[name]()
        except Exception as exc:  # a broken install can raise more than ImportError
            notes.append(f"{name}: not available ({_one_line(exc)})")
            if explicit or name == FLASH_CUDA:
                backends[name] = None
    return backends


def _one_line(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def make_timer(kind, warmup_ms, rep_ms):
    """Returns ({name: fn}, first) -> {name: median milliseconds per call}; see the module's
    docstring for the two kinds."""
    if kind == "interleaved":
        return lambda calls, first: time_in_turns(calls, warmup_ms, rep_ms, first)
    try:
        from triton.testing import do_bench

        def one(fn):
            return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    except ImportError:
        def one(fn):
            return time_in_turns({None: fn}, warmup_ms, rep_ms)[None]

    def sequential(calls, first):
        return {name: one(calls[name]) for name in turn_order(list(calls), first)}

    return sequential


def turn_order(names, turn):
    """The order of turn `turn`, from a Williams design: over 2 * len(names) turns each name
    comes first equally often and follows each other name equally often.  Row 0 is 0, 1, n-1,
    2, n-2, ...; row r adds r to each index (mod n); with n odd the rows also run reversed."""
    count = len(names)
    if count == 0:
        return []
    row0 = [0]
    for step in range(1, count):
        row0.append((step + 1) // 2 if step % 2 else count - step // 2)
    order = [names[(index + turn) % count] for index in row0]
    return order[::-1] if count % 2 and (turn // count) % 2 else order


def time_in_turns(fns, warmup_ms, rep_ms, first=0):
    """{name: fn} -> {name: median milliseconds per call}, the calls taken in turns.

    Each turn calls every fn once, in turn_order, each call after the L2 is emptied and the GPU
    held HOST_COVER_CYCLES (so that the call's kernels are queued before its start event is
    reached), between its own pair of CUDA events. Warm-up and timing take about warmup_ms and
    rep_ms per fn, as do_bench's do for one (the counts come from a few calls with L2 warm and
    no flush, so short calls run somewhat longer than that).
    """
    names = list(fns)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    estimate = {}
    for name in names:
        fns[name]()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fns[name]()
        end.record()
        torch.cuda.synchronize()
        estimate[name] = max(start.elapsed_time(end) / 3, 1e-3)
    turn_ms = sum(estimate.values())
    for _ in range(max(1, round(warmup_ms * len(names) / turn_ms))):
        for name in names:
            flush.zero_()
            fns[name]()
    turns = min(10000, max(5, round(rep_ms * len(names) / turn_ms)))
    events = {name: [] for name in names}
    for turn in range(turns):
        for name in turn_order(names, first + turn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            flush.zero_()
            torch.cuda._sleep(HOST_COVER_CYCLES)
            start.record()
            fns[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(a.elapsed_time(b) for a, b in pairs)
            for name, pairs in events.items()}


def make_call(backend, qkv, causal, direction):
    """A no-argument call of `backend` on q, k, v (batch, seqlen, heads, hdim), run once here
    so that a point the backend cannot run fails before any timing."""
    with backend.context():
        if direction == "fwd":
            inputs = backend.prepare(*qkv)
            forward = backend.forward

            def call():
                with backend.context():
                    forward(*inputs, causal)
        else:
            # Fresh leaves per backend so no graph or gradient is shared between backends.
            leaves = [t.detach().requires_grad_() for t in qkv]
            inputs = backend.prepare(*leaves)
            out = backend.forward(*inputs, causal)
            dout = torch.randn_like(out)

            # autograd.grad returns the gradients instead of accumulating into .grad, so
            # repeated calls do no extra work and time only the backward kernels.
            def call():
                torch.autograd.grad(out, inputs, dout, retain_graph=True)
        call()
    return call


def run_point(backends, shape, causal, direction, dtype, timer, notes, first=0):
    """Times every backend at one point, `first` saying which one starts (rounds rotate it);
    returns {name: TFLOP/s or None} in the backends' order."""
    batch, seqlen, heads, hdim = shape
    qkv = [torch.randn(shape, dtype=dtype, device="cuda") for _ in range(3)]
    flops = attention_flops(batch, heads, seqlen, hdim, causal, direction)

    def gap(name, exc):  # unsupported head dim, OOM, no kernel: a gap, not a crash
        reason = _one_line(exc)
        # A backend lacking a kernel fails the same way at every point; say so once on the
        # console and keep every occurrence in the JSON.
        note = f"{name} {direction} hdim={hdim} causal={_yes_no(causal)} seqlen={seqlen}: {reason}"
        if not any(n.startswith(name + " ") and n.endswith(reason) for n in notes):
            print(f"  note: {note} (repeats not shown)", flush=True)
        notes.append(note)
        torch.cuda.empty_cache()

    calls = {}
    for name, backend in backends.items():
        if backend is None:
            continue
        try:
            calls[name] = make_call(backend, qkv, causal, direction)
        except Exception as exc:
            gap(name, exc)
    ms = {}
    if calls:
        try:
            ms = timer(calls, first)
        except Exception:
            # One backend failing while timed costs only its own number: time each alone.
            torch.cuda.empty_cache()
            for name, call in calls.items():
                try:
                    ms.update(timer({name: call}, 0))
                except Exception as exc:
                    gap(name, exc)
    return {name: (flops / (ms[name] * 1e9) if name in ms else None) for name in backends}


def run_grid(args, backends, timer, notes, first=0):
    """Runs every (direction, hdim, causal, seqlen) point; returns a list of Points."""
    points = []
    for direction in args.directions:
        for hdim in args.hdims:
            for causal in args.causal:
                for seqlen in args.seqlens:
                    batch, heads = args.tokens // seqlen, args.model_dim // hdim
                    shape = (batch, seqlen, heads, hdim)
                    tflops = run_point(backends, shape, causal, direction, args.dtype,
                                       timer, notes, first)
                    point = Point(direction, hdim, causal, seqlen, batch, heads, tflops)
                    points.append(point)
                    print(f"{_row_label(point)}  " + "  ".join(
                        f"{n} {_fmt(v, '.1f')}" for n, v in tflops.items()), flush=True)
    return points


def merge_rounds(rounds):
    """One Point per grid point from several runs of the grid: the median TFLOP/s of each
    backend over the rounds where it ran (None where it never did)."""
    merged = []
    for same in zip(*rounds):
        first = same[0]
        tflops = {}
        for name in first.tflops:
            values = [p.tflops[name] for p in same if p.tflops.get(name) is not None]
            tflops[name] = statistics.median(values) if values else None
        merged.append(dataclasses.replace(first, tflops=tflops, rounds=[p.tflops for p in same]))
    return merged


def ratios(point):
    """flash_cuda over sdpa_flash, over sdpa_cudnn and over the fastest peer at one point."""
    mine = point.tflops.get(FLASH_CUDA)
    peers = [v for n, v in point.tflops.items() if n != FLASH_CUDA and v is not None]
    best = max(peers) if peers else None

    def over(other):
        return mine / other if mine is not None and other else None

    return {
        "flash_cuda/sdpa_flash": over(point.tflops.get(SDPA_FLASH)),
        "flash_cuda/sdpa_cudnn": over(point.tflops.get(SDPA_CUDNN)),
        "flash_cuda/best_peer": over(best),
    }


def geomeans(points):
    """Geometric mean of each ratio over the points where it is defined: {ratio: (mean, n)}."""
    logs = {}
    for point in points:
        for key, value in ratios(point).items():
            logs.setdefault(key, [])
            if value is not None:
                logs[key].append(math.log(value))
    return {k: (math.exp(sum(v) / len(v)) if v else None, len(v)) for k, v in logs.items()}


def _yes_no(flag):
    return "yes" if flag else "no"


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _fmt_ratio(value):
    return "-" if value is None else f"{value:.3f}x"


def _row_label(point):
    return (f"{point.direction:>3} {point.hdim:>4} {_yes_no(point.causal):>6} "
            f"{point.seqlen:>6}")


def format_table(points, names):
    """The results as a fixed-width text table, one row per point."""
    ratio_keys = ["flash_cuda/sdpa_flash", "flash_cuda/sdpa_cudnn", "flash_cuda/best_peer"]
    widths = [max(len(n), 7) for n in names] + [len(k) for k in ratio_keys]
    header = "dir hdim causal seqlen | " + " ".join(
        n.rjust(w) for n, w in zip(names + ratio_keys, widths))
    lines = ["TFLOP/s and ratios (- = did not run)", header, "-" * len(header)]
    for point in points:
        values = [_fmt(point.tflops.get(n), ".1f") for n in names]
        values += [_fmt_ratio(r) for r in ratios(point).values()]
        lines.append(_row_label(point) + " | " + " ".join(
            v.rjust(w) for v, w in zip(values, widths)))
    return "\n".join(lines)


def format_geomeans(points):
    """One line per direction present (when more than one), then the whole-grid line."""
    groups = list(dict.fromkeys(p.direction for p in points))
    scopes = []
    if len(groups) > 1:
        scopes = [(d, [p for p in points if p.direction == d]) for d in groups]
    scopes.append(("grid", points))
    lines = []
    for scope, members in scopes:
        parts = [f"{key} {_fmt_ratio(mean)} ({count} pts)"
                 for key, (mean, count) in geomeans(members).items()]
        lines.append(f"geomean over {scope}: " + ", ".join(parts))
    return "\n".join(lines)


def environment():
    """What the numbers depend on, recorded next to them."""
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
    }


def write_json(path, args, env, names, points, notes):
    config = {
        "tokens": args.tokens, "model_dim": args.model_dim, "dtype": args.dtype_name,
        "hdims": args.hdims, "seqlens": args.seqlens, "causal": args.causal,
        "directions": args.directions, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
        "rounds": args.rounds, "timer": args.timer,
    }
    rows = []
    for p in points:
        flops = attention_flops(p.batch, p.heads, p.seqlen, p.hdim, p.causal, p.direction)
        ms = {n: (flops / (v * 1e9) if v else None) for n, v in p.tflops.items()}
        rows.append(dict(dataclasses.asdict(p), flops=flops, ms=ms, ratios=ratios(p)))
    means = {k: {"geomean": m, "points": n} for k, (m, n) in geomeans(points).items()}
    payload = {"environment": env, "config": config, "backends": names, "results": rows,
               "geomeans": means, "notes": notes}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def write_plot(path, names, points):
    """TFLOP/s against seqlen, one panel per (direction, causal) row and head dim column."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; skipping the plot {path}")
        return
    rows = sorted({(p.direction, p.causal) for p in points}, key=lambda r: (r[0] != "fwd", r[1]))
    hdims = sorted({p.hdim for p in points})
    fig, axes = plt.subplots(len(rows), len(hdims), squeeze=False,
                             figsize=(4.5 * len(hdims), 3.5 * len(rows)))
    for (direction, causal), row_axes in zip(rows, axes):
        for hdim, ax in zip(hdims, row_axes):
            key = (direction, causal, hdim)
            panel = [p for p in points if (p.direction, p.causal, p.hdim) == key]
            for name in names:
                xs = [p.seqlen for p in panel if p.tflops.get(name) is not None]
                ys = [p.tflops[name] for p in panel if p.tflops.get(name) is not None]
                if xs:
                    ax.plot(xs, ys, marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction} hdim {hdim} causal {_yes_no(causal)}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def _int_list(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hdims", type=_int_list, default=[64, 128, 256],
                        help="comma list of head dims (default 64,128,256)")
    parser.add_argument("--seqlens", type=_int_list,
                        default=[512, 1024, 2048, 4096, 8192, 16384],
                        help="comma list of sequence lengths (default 512..16384)")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--direction", choices=["fwd", "bwd", "both"], default="both")
    parser.add_argument("--backends", default=None,
                        help=f"comma list from {','.join(ALL_BACKENDS)}; default: all importable")
    parser.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    parser.add_argument("--model-dim", type=int, default=2048, help="heads * hdim")
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--timer", choices=["interleaved", "sequential"], default="interleaved",
                        help="backends in turns, call by call (default), or one after the other")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the grid this many times; report each point's median")
    parser.add_argument("--json", metavar="PATH", help="write all numbers and the environment")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    _check_args(parser, args)
    args.dtype_name, args.dtype = args.dtype, DTYPES[args.dtype]
    args.causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    args.directions = ["fwd", "bwd"] if args.direction == "both" else [args.direction]
    args.explicit = args.backends is not None
    args.backends = args.backends.split(",") if args.explicit else list(ALL_BACKENDS)
    return args


def _check_args(parser, args):
    """Rejects a grid that cannot be built before anything touches the GPU."""
    unknown = set(args.backends.split(",") if args.backends else []) - set(ALL_BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {list(ALL_BACKENDS)}")
    for seqlen in args.seqlens:
        if seqlen <= 0 or seqlen > args.tokens:
            parser.error(f"seqlen {seqlen} must be in 1..{args.tokens} (--tokens) so batch >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1; got {args.rounds}")
    for hdim in args.hdims:
        if hdim <= 0 or args.model_dim % hdim:
            parser.error(f"hdim {hdim} must divide the model dim {args.model_dim}")


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attn.py: no CUDA device is visible (torch.cuda.is_available() is False); "
              "this benchmark times GPU kernels and needs one.", file=sys.stderr)
        return 2
    env = environment()
    print(f"device: {env['gpu']} (sm_{env['compute_capability'].replace('.', '')}), "
          f"torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
          f"timer: {args.timer}, dtype {args.dtype_name}")
    notes = []
    backends = load_backends(args.backends, args.explicit, notes)
    for note in notes:
        print(f"note: {note}")
    names = list(backends)
    torch.manual_seed(0)
    timer = make_timer(args.timer, args.warmup_ms, args.rep_ms)
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        rounds.append(run_grid(args, backends, timer, notes, first=r))
    points = merge_rounds(rounds)
    if args.json:
        write_json(args.json, args, env, names, points, notes)
    if args.plot:
        write_plot(args.plot, names, points)
    print()
    print(format_table(points, names))
    print(format_geomeans(points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
