"""Attention over a KV cache: GB/s of K and V read (and microseconds per call) for one-token
decode and for chunked prefill, flash_cuda next to its peers in the same run.

Each backend is called directly in its own layout, the inputs built outside the timing:
- flash_cuda: flash_attn_with_kvcache over a dense (batch, seqlen_cache, heads_kv, d) cache or
  a paged one (num_pages, page_size, heads_kv, d) whose page table hands the pages out in a
  random order;
- flash_cuda_fwd (dense layout only): flash_attn_func with the cache as K and V;
- sdpa_cudnn / sdpa_flash: scaled_dot_product_attention on the dense equivalent in SDPA's own
  layout, a (batch, heads_kv, seqlen, d) cache (enable_gqa=True; where a backend refuses it, K
  and V are repeated to the query heads outside the timing, which the notes say);
- fa4_cute (when flash_attn.cute imports): its varlen function over the same paged cache.
Every backend of a point is timed in turns with the others (bench_attn.py's interleaved
timer: L2 emptied before each call), so all run under one power state. A backend that cannot
run a point records nothing and the reason goes to the notes. The dense peers (SDPA and
flash_cuda_fwd) are timed once per point, with the dense layout; each paged layout is timed in
turns with flash_cuda over the dense cache (`flash_cuda_dense`, the paged / dense ratio) and
FlashAttention-4, and its row repeats the dense peers' numbers (`peers_from: dense`). A point
whose caches (with their paged and SDPA copies) would not fit the device's free memory is
skipped, with a note.

Bytes counted: K and V of the keys each call reads, 2 * batch * keys * heads_kv * d * 2 bytes
(the cache rows a sequence sees), so that GB/s compare across layouts and with the device's copy
rate, which the run also measures (a 1 GiB device-to-device copy, bytes read plus written).
Chunked prefill: `--prefill` adds cases of 512-2048 new query tokens against 8k-32k cached
keys (the new keys already in the cache, bottom-right causal), also in TFLOP/s.  `--rope` adds
flash_cuda decode steps that append the step's token with rotary embedding, the cos / sin tables
(32k positions, as a model holds them) in the cache's dtype and in float32.  `--env
FLASH_CUDA_NAME=VALUE[,...]` adds flash_cuda with those variables set around each call, timed in
the same turns: an A/B of code paths of one build (knobs read at every call).

Run:
    python benchmarks/bench_decode.py                          # the TARGETS.md decode points
    python benchmarks/bench_decode.py --layouts dense,1,16,64,256 --heads 32/8,8/1,64/64 \\
        --hdims 64,128,256 --json decode.json --plot decode.png
    python benchmarks/bench_decode.py --batches 1,4,16,64,128 --caches 1024,8192,32768,131072
"""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attn  # noqa: E402  (the timer, the environment record, error lines)

# (batch, cache length) of TARGETS.md's decode table.
TARGET_POINTS = ((1, 8192), (1, 32768), (1, 131072), (4, 8192), (16, 8192), (64, 4096),
                 (128, 2048))
PREFILL_CASES = ((1, 512, 8192), (1, 2048, 8192), (1, 2048, 32768), (4, 512, 32768))
BACKENDS = ("flash_cuda", "flash_cuda_fwd", "sdpa_cudnn", "sdpa_flash", "fa4_cute")
DENSE_PEERS = ("flash_cuda_fwd", "sdpa_cudnn", "sdpa_flash")
# A point's peak device memory in units of one of its K / V caches: K and V, then either SDPA's
# transposed copies of both (dense) or the pages of both plus one padded copy (paged).
MEMORY_FACTOR = 5
COPY_BYTES = 1 << 30
# Positions in the rotary tables of --rope: a model's whole table, not the cache's length.
ROPE_POSITIONS = 32768


def kv_bytes(batch, keys, heads_kv, hdim, element_bytes):
    """Bytes of K and V one call reads."""
    return 2 * batch * keys * heads_kv * hdim * element_bytes


def prefill_flops(batch, new, keys, heads_q, hdim):
    """Visible scores of `new` queries against `keys` keys (the last `new` of them new),
    bottom-right causal: QK^T and PV, 2 FLOPs per multiply-add each."""
    visible = new * (keys - new) + new * (new + 1) / 2
    return 4 * batch * heads_q * hdim * visible


def page_table(batch, keys, page_size, generator):
    """(table (batch, pages per sequence) int32, number of pages): every sequence's pages,
    handed out in a random order over the whole pool."""
    per_seq = -(-keys // page_size)
    order = torch.randperm(batch * per_seq, generator=generator).to(torch.int32)
    return order.view(batch, per_seq), batch * per_seq


def to_paged(cache, table, page_size):
    """A dense (batch, seqlen, heads, d) cache laid out in the pages of `table`."""
    batch, seqlen = cache.shape[:2]
    per_seq = table.shape[1]
    padded = cache.new_zeros(batch, per_seq * page_size, *cache.shape[2:])
    padded[:, :seqlen] = cache
    pages = cache.new_empty(table.numel(), page_size, *cache.shape[2:])
    pages[table.flatten().long()] = padded.view(batch * per_seq, page_size, *cache.shape[2:])
    return pages


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend
    return {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa_flash": SDPBackend.FLASH_ATTENTION}[name]


def make_calls(backends, batch, new, keys, heads, hdim, layout, dtype, notes, seed=0,
               splits=(), rope=False, envs=()):
    """{name: no-argument call} of one point, each run once here (a backend that fails is left
    out, its error in `notes`).  `splits`: flash_cuda also as `flash_cuda_sN`, with num_splits=N
    forced (a sweep of the split count against the heuristic's).  `rope` (decode points):
    flash_cuda also as `flash_cuda_rope` / `flash_cuda_rope_f32`, the step's token appended to
    the cache (its last row) and rotated with q by cos / sin tables of ROPE_POSITIONS rows in the
    cache's dtype / in float32.  `envs` ("NAME=VALUE[,NAME=VALUE...]" each): flash_cuda also as
    `flash_cuda[spec]`, the variables set around each call (knobs read at every call: an A/B of
    code paths of one build in the same turns)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    heads_q, heads_kv = heads
    g = torch.Generator().manual_seed(seed)  # the page order
    gpu = torch.Generator("cuda").manual_seed(seed)
    dense = torch.randn(2, batch, keys, heads_kv, hdim, generator=gpu, device="cuda",
                        dtype=dtype)
    k_dense, v_dense = dense[0], dense[1]
    q = torch.randn(batch, new, heads_q, hdim, generator=gpu, device="cuda", dtype=dtype)
    lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    calls = {}

    def attempt(name, fn):
        try:
            fn()
            torch.cuda.synchronize()
            calls[name] = fn
        except Exception as exc:  # a peer's failure is data, not a crash
            notes.append(f"{name} b{batch} n{new} k{keys} h{heads_q}/{heads_kv} d{hdim} "
                         f"{layout}: {bench_attn._one_line(exc)}")

    if layout == "dense":
        k_cache, v_cache, table, page_size = k_dense, v_dense, None, None
    else:
        page_size = int(layout)
        table, _ = page_table(batch, keys, page_size, g)
        k_cache, v_cache = (to_paged(t, table.cuda(), page_size) for t in (k_dense, v_dense))
        table = table.cuda()
    if "flash_cuda" in backends:
        from flash_cuda import flash_attn_with_kvcache
        attempt("flash_cuda", lambda: flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lengths, page_table=table, causal=True))
        for n in splits:
            attempt(f"flash_cuda_s{n}", lambda n=n: flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=lengths, page_table=table, causal=True,
                num_splits=n))
        for spec in envs:
            settings = dict(item.partition("=")[::2] for item in spec.split(","))

            def with_env(settings=settings):
                before = {name: os.environ.get(name) for name in settings}
                os.environ.update(settings)
                try:
                    return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                   page_table=table, causal=True)
                finally:
                    for name, value in before.items():
                        if value is None:
                            del os.environ[name]
                        else:
                            os.environ[name] = value
            attempt(f"flash_cuda[{spec}]", with_env)
        if rope and new == 1:
            angles = torch.rand(max(keys, ROPE_POSITIONS), hdim // 2, generator=gpu,
                                device="cuda") * 6.28
            k_new, v_new = (torch.randn(batch, 1, heads_kv, hdim, generator=gpu, device="cuda",
                                        dtype=dtype) for _ in range(2))
            cached = lengths - 1
            for name, table_dtype in (("flash_cuda_rope", dtype),
                                      ("flash_cuda_rope_f32", torch.float32)):
                cos, sin = angles.cos().to(table_dtype), angles.sin().to(table_dtype)
                attempt(name, lambda cos=cos, sin=sin: flash_attn_with_kvcache(
                    q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                    cache_seqlens=cached, page_table=table, causal=True))
        if table is not None:  # the dense cache in the same turns: paged / dense
            attempt("flash_cuda_dense", lambda: flash_attn_with_kvcache(
                q, k_dense, v_dense, cache_seqlens=lengths, causal=True))
    if "fa4_cute" in backends and table is not None:
        try:
            from flash_attn.cute import flash_attn_varlen_func as fa4_varlen
            cu_q = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device="cuda")
            q_packed = q.flatten(0, 1)
            attempt("fa4_cute", lambda: fa4_varlen(
                q_packed, k_cache, v_cache, cu_seqlens_q=cu_q, cu_seqlens_k=None,
                seqused_k=lengths, page_table=table, causal=True))
        except ImportError as exc:
            notes.append(f"fa4_cute: {bench_attn._one_line(exc)}")
    if table is not None:
        return calls  # the dense peers are timed with the dense layout
    if "flash_cuda_fwd" in backends and table is None:
        # The ordinary forward over the dense cache as K and V (no split of the keys): what a
        # caller without the KV-cache API gets.
        from flash_cuda import flash_attn_func
        k_used, v_used = k_dense, v_dense
        attempt("flash_cuda_fwd", lambda: flash_attn_func(q, k_used, v_used, causal=True))
    # SDPA in its own layout: (batch, heads, seqlen, d), contiguous.
    qt = q.transpose(1, 2).contiguous()
    kt, vt = (t.transpose(1, 2).contiguous() for t in (k_dense, v_dense))
    mask = causal_lower_right(new, keys) if new > 1 else None
    for name in ("sdpa_cudnn", "sdpa_flash"):
        if name not in backends:
            continue
        backend = _sdpa_backend(name)

        def sdpa(k=kt, v=vt, gqa=True, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, k, v, attn_mask=mask,
                                                      enable_gqa=gqa and heads_q != heads_kv)
        before = len(calls)
        attempt(name, sdpa)
        if len(calls) == before and heads_q != heads_kv:  # refused GQA: repeat K and V
            r = heads_q // heads_kv
            ke, ve = (t.repeat_interleave(r, dim=1) for t in (kt, vt))
            attempt(name, lambda sdpa=sdpa, ke=ke, ve=ve: sdpa(ke, ve, False))
            if name in calls:
                notes.append(f"{name}: enable_gqa refused; K, V repeated to {heads_q} heads "
                             "outside the timing")
    return calls


def copy_rate(timer):
    """GB/s of a 1 GiB device-to-device copy (bytes read plus written)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer({"copy": lambda: dst.copy_(src)}, 0)["copy"]
    return 2 * COPY_BYTES / (ms * 1e6)


def _int_list(text):
    return [int(x) for x in text.split(",") if x]


def _heads_list(text):
    pairs = []
    for item in text.split(","):
        q, _, kv = item.partition("/")
        pairs.append((int(q), int(kv or q)))
    return pairs


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=_int_list, help="with --caches: their product "
                        "(default: the TARGETS.md (batch, cache) points)")
    parser.add_argument("--caches", type=_int_list, help="cache lengths, with --batches")
    parser.add_argument("--heads", type=_heads_list, default=[(32, 8)],
                        help="query/kv head pairs, e.g. 32/8,8/1,64/64 (default 32/8)")
    parser.add_argument("--hdims", type=_int_list, default=[128])
    parser.add_argument("--layouts", default="dense,16,1",
                        help="dense and/or page sizes, e.g. dense,1,16,64,256")
    parser.add_argument("--prefill", action="store_true",
                        help="also chunked prefill: 512-2048 new tokens against 8k-32k cached")
    parser.add_argument("--splits", type=_int_list, default=[],
                        help="flash_cuda also with num_splits forced to each, e.g. 8,32,128 "
                        "(columns flash_cuda_sN)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE[,...]",
                        help="flash_cuda also with these FLASH_CUDA_* variables set around each "
                        "call, in the same turns (column flash_cuda[spec]; for knobs read at "
                        "every call, e.g. FLASH_CUDA_FAMILY=sm80); repeatable")
    parser.add_argument("--rope", action="store_true",
                        help="flash_cuda also with the step's token appended and rotated "
                        "(tables in the cache's dtype and in float32: columns flash_cuda_rope, "
                        "flash_cuda_rope_f32)")
    parser.add_argument("--dtype", choices=sorted(bench_attn.DTYPES), default="bf16")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--warmup-ms", type=float, default=25.0)
    parser.add_argument("--rep-ms", type=float, default=100.0)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH")
    args = parser.parse_args(argv)
    if (args.batches is None) != (args.caches is None):
        parser.error("--batches and --caches go together (their product), or neither")
    args.layouts = [x for x in args.layouts.split(",") if x]
    for layout in args.layouts:
        if layout != "dense" and not (layout.isdigit() and int(layout) >= 1):
            parser.error(f"--layouts takes dense or page sizes >= 1; got {layout!r}")
    args.backends = [x for x in args.backends.split(",") if x]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {', '.join(BACKENDS)}")
    for q, kv in args.heads:
        if kv < 1 or q % kv:
            parser.error(f"--heads {q}/{kv}: query heads must be a multiple of kv heads >= 1")
    for d in args.hdims:
        if not (8 <= d <= 256 and d % 8 == 0):
            parser.error(f"--hdims: {d} is not a multiple of 8 in 8..256")
    if any(n < 1 for n in args.splits):
        parser.error("--splits takes split counts >= 1")
    if args.splits and "flash_cuda" not in args.backends:
        parser.error("--splits times flash_cuda: name it in --backends")
    if args.rope and "flash_cuda" not in args.backends:
        parser.error("--rope times flash_cuda: name it in --backends")
    for spec in args.env:
        for item in spec.split(","):
            variable, sep, _ = item.partition("=")
            if not sep or not variable.startswith("FLASH_CUDA_"):
                parser.error(f"--env takes FLASH_CUDA_NAME=VALUE[,...]; got {spec!r}")
    if args.env and "flash_cuda" not in args.backends:
        parser.error("--env times flash_cuda: name it in --backends")
    sizes = (args.batches or []) + (args.caches or [])
    if any(n < 1 for n in sizes):
        parser.error("--batches and --caches take positive sizes")
    return args


def points(args):
    """(batch, new tokens, keys) of every case."""
    if args.batches is None:
        cases = [(b, 1, k) for b, k in TARGET_POINTS]
    else:
        cases = [(b, 1, k) for b in args.batches for k in args.caches]
    if args.prefill:
        cases += list(PREFILL_CASES)
    return cases


def main(argv=None):
    args = parse_args(argv)
    dtype = bench_attn.DTYPES[args.dtype]
    element = torch.finfo(dtype).bits // 8
    timer = bench_attn.make_timer("interleaved", args.warmup_ms, args.rep_ms)
    notes, rows = [], []
    copy_gbs = copy_rate(timer)
    environment = bench_attn.environment()
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    names = args.backends + [f"flash_cuda_s{n}" for n in args.splits]
    names += [f"flash_cuda[{spec}]" for spec in args.env]
    if args.rope:
        names += ["flash_cuda_rope", "flash_cuda_rope_f32"]
    if "flash_cuda" in args.backends and any(x != "dense" for x in args.layouts):
        names.append("flash_cuda_dense")
    # The dense layout first: its peers' numbers go into the paged rows of the point.
    layouts = sorted(args.layouts, key=lambda x: x != "dense")
    for batch, new, keys in points(args):
        for heads in args.heads:
            for hdim in args.hdims:
                nbytes = kv_bytes(batch, keys, heads[1], hdim, element)
                free = torch.cuda.mem_get_info()[0]
                if MEMORY_FACTOR * nbytes / 2 > 0.9 * free:
                    notes.append(f"skipped b{batch} n{new} k{keys} h{heads[0]}/{heads[1]} "
                                 f"d{hdim}: {MEMORY_FACTOR * nbytes / 2 ** 31:.1f} GiB needed, "
                                 f"{free / 2 ** 30:.1f} free")
                    continue
                peers = {}
                for layout in layouts:
                    calls = make_calls(args.backends, batch, new, keys, heads, hdim, layout,
                                       dtype, notes, splits=args.splits,
                                       rope=args.rope, envs=args.env)
                    if calls and not rows:
                        # The run's first point is timed twice, the first time thrown away: its
                        # numbers read up to 6x low for every backend alike in some runs.
                        timer(calls, 0)
                    ms = timer(calls, len(rows)) if calls else {}
                    del calls
                    torch.cuda.empty_cache()
                    row = {"batch": batch, "new": new, "keys": keys, "heads_q": heads[0],
                           "heads_kv": heads[1], "hdim": hdim, "layout": layout,
                           "us": {n: ms[n] * 1e3 for n in ms},
                           "gbs": {n: nbytes / (ms[n] * 1e6) for n in ms}}
                    if new > 1:
                        flops = prefill_flops(batch, new, keys, heads[0], hdim)
                        row["tflops"] = {n: flops / (ms[n] * 1e9) for n in ms}
                    if layout == "dense":
                        peers = {key: {n: v for n, v in row[key].items() if n in DENSE_PEERS}
                                 for key in ("us", "gbs", "tflops") if key in row}
                    elif peers:
                        for key, values in peers.items():
                            row[key].update(values)
                        row["peers_from"] = "dense"
                    rows.append(row)
                    print(format_row(row, names), flush=True)
                    if args.json:  # what a run cut short has measured survives it
                        save(args.json, environment, args, copy_gbs, rows, notes)
    print("\n" + format_table(rows, names))
    for note in dict.fromkeys(notes):
        print("note:", note)
    if args.json:
        save(args.json, environment, args, copy_gbs, rows, notes)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, rows, args.backends, copy_gbs)


def save(path, environment, args, copy_gbs, rows, notes):
    payload = {"environment": environment, "config": vars(args), "copy_gbs": copy_gbs,
               "results": rows, "notes": list(dict.fromkeys(notes))}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def _label(row):
    kind = "decode" if row["new"] == 1 else f"prefill {row['new']}"
    return (f"{kind} b{row['batch']} k{row['keys']} h{row['heads_q']}/{row['heads_kv']} "
            f"d{row['hdim']} {row['layout']}")


def best_peer(row):
    peers = {n: v for n, v in row["gbs"].items() if not n.startswith("flash_cuda")}
    return max(peers.values()) if peers else None


def paged_over_dense(row):
    """flash_cuda's paged GB/s over its dense GB/s timed in the same turns (paged rows)."""
    ours, dense = row["gbs"].get("flash_cuda"), row["gbs"].get("flash_cuda_dense")
    return ours / dense if ours and dense else None


def format_row(row, names):
    cells = [f"{n} {row['gbs'][n]:.0f} GB/s {row['us'][n]:.1f} us" for n in names
             if n in row["gbs"]]
    return f"{_label(row)}: " + ("; ".join(cells) or "nothing ran")


def format_table(rows, names):
    head = ("case | " + " | ".join(f"{n} GB/s" for n in names) +
            " | flash_cuda / best peer | paged / dense")
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = [f"{row['gbs'][n]:.0f}" if n in row["gbs"] else "-" for n in names]
        peer, ours = best_peer(row), row["gbs"].get("flash_cuda")
        ratio = f"{ours / peer:.3f}x" if ours and peer else "-"
        paged = paged_over_dense(row)
        lines.append(f"{_label(row)} | " + " | ".join(cells) + f" | {ratio} | " +
                     (f"{paged:.3f}" if paged else "-"))
    return "\n".join(lines)


def write_plot(path, rows, names, copy_gbs):
    """GB/s per decode case, one bar per backend, the copy rate as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    decode = [r for r in rows if r["new"] == 1]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(decode)), 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j, r in enumerate(decode) if name in r["gbs"]]
        ys = [r["gbs"][name] for r in decode if name in r["gbs"]]
        ax.bar(xs, ys, width, label=name)
    ax.axhline(copy_gbs, color="k", linestyle="--", linewidth=1, label="device copy")
    ax.set_xticks([j + 0.4 for j in range(len(decode))])
    ax.set_xticklabels([_label(r) for r in decode], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("GB/s of K and V read")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
