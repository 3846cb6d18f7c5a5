"""Forward throughput on shapes real models run that the TARGETS.md grid does not cover: GQA
(32 query / 8 KV heads, head dim 128) and a packed varlen batch of mixed lengths, causal, against
PyTorch SDPA's cuDNN and flash backends in the same run (bench_attn.py's interleaved timer).

Peers get each case in their own API: dense GQA through `enable_gqa=True` (or, where a backend
refuses it, K and V repeated to the query heads outside the timed region, noted in the output);
the packed batch as nested (jagged) tensors.  A peer that cannot run a case records None and
the reason.  FLOPs count the visible scores only: 4 * heads * d * (sum of s_q * s_k, halved
for causal squares) over the sequences.

Run:
    python benchmarks/bench_shapes.py
    python benchmarks/bench_shapes.py --json out.json
"""

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_attn  # noqa: E402  (the timer and the environment record)

# A packed batch of the kind a data loader produces: long and short documents, one of odd size.
VARLEN_LENGTHS = (4096, 3000, 2048, 1500, 1333, 1024, 1024, 777, 512, 512, 300, 256, 77, 1)
HEADS, HEADS_KV, HDIM = 32, 8, 128


def _sdpa(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_flash": SDPBackend.FLASH_ATTENTION}[kind]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call(q, k, v, causal, **kw):
        with sdpa_kernel([backend]):
            return sdpa(q, k, v, is_causal=causal, **kw)

    return call


def dense_gqa_case(batch, seqlen, causal, dtype, notes):
    """{name: fn} for a dense GQA problem, and its FLOPs."""
    from flash_cuda import flash_attn_func
    q = torch.randn(batch, seqlen, HEADS, HDIM, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, seqlen, HEADS_KV, HDIM, device="cuda", dtype=dtype)
            for _ in range(2))
    calls = {"flash_cuda": lambda: flash_attn_func(q, k, v, causal=causal)}
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    for name in ("sdpa_cudnn", "sdpa_flash"):
        sdpa = _sdpa(name)
        try:
            sdpa(qt, kt, vt, causal, enable_gqa=True)
            calls[name] = lambda sdpa=sdpa: sdpa(qt, kt, vt, causal, enable_gqa=True)
        except RuntimeError as exc:
            r = HEADS // HEADS_KV
            ke, ve = (t.repeat_interleave(r, dim=1) for t in (kt, vt))
            try:
                sdpa(qt, ke, ve, causal)
                calls[name] = lambda sdpa=sdpa, ke=ke, ve=ve: sdpa(qt, ke, ve, causal)
                notes.append(f"{name}: enable_gqa refused ({bench_attn._one_line(exc)}); "
                             "K, V repeated to 32 heads outside the timing")
            except RuntimeError as exc2:
                notes.append(f"{name}: {bench_attn._one_line(exc2)}")
    flops = 4 * batch * HEADS * HDIM * seqlen * seqlen / (2 if causal else 1)
    return calls, flops


def varlen_case(lengths, causal, dtype, notes):
    """{name: fn} for a packed batch of `lengths`, and its FLOPs."""
    from flash_cuda import flash_attn_varlen_func
    total = sum(lengths)
    q = torch.randn(total, HEADS, HDIM, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, HEADS_KV, HDIM, device="cuda", dtype=dtype) for _ in range(2))
    cu = torch.tensor([0] + list(lengths), device="cuda").cumsum(0).to(torch.int32)
    longest = max(lengths)
    calls = {"flash_cuda": lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                          causal=causal)}
    offsets = cu.to(torch.int64)
    r = HEADS // HEADS_KV
    nested = [torch.nested.nested_tensor_from_jagged(t, offsets).transpose(1, 2)
              for t in (q, k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1))]
    for name in ("sdpa_cudnn", "sdpa_flash"):
        sdpa = _sdpa(name)
        try:
            sdpa(*nested, causal)
            calls[name] = lambda sdpa=sdpa: sdpa(*nested, causal)
            notes.append(f"{name}: varlen as nested jagged tensors, K, V repeated to 32 heads "
                         "outside the timing")
        except RuntimeError as exc:
            notes.append(f"{name} varlen: {bench_attn._one_line(exc)}")
    flops = sum(4 * HEADS * HDIM * s * s / (2 if causal else 1) for s in lengths)
    return calls, flops


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(bench_attn.DTYPES), default="bf16")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    dtype = bench_attn.DTYPES[args.dtype]
    timer = bench_attn.make_timer("interleaved", 25.0, 100.0)
    notes, rows = [], []
    cases = [("gqa 32/8 d128 causal 4k x4", lambda: dense_gqa_case(4, 4096, True, dtype, notes)),
             ("gqa 32/8 d128 4k x4", lambda: dense_gqa_case(4, 4096, False, dtype, notes)),
             ("gqa 32/8 d128 causal 16k x1", lambda: dense_gqa_case(1, 16384, True, dtype, notes)),
             (f"varlen {len(VARLEN_LENGTHS)} seqs gqa 32/8 d128 causal",
              lambda: varlen_case(VARLEN_LENGTHS, True, dtype, notes)),
             (f"varlen {len(VARLEN_LENGTHS)} seqs gqa 32/8 d128",
              lambda: varlen_case(VARLEN_LENGTHS, False, dtype, notes))]
    for label, make in cases:
        calls, flops = make()
        ms = timer(calls, 0)
        tflops = {name: flops / (ms[name] * 1e9) for name in ms}
        rows.append({"case": label, "tflops": tflops})
        print(label, "  ".join(f"{n} {v:.1f}" for n, v in tflops.items()), flush=True)
    print("\ncase | flash_cuda | sdpa_cudnn | sdpa_flash | flash_cuda/sdpa_cudnn")
    for row in rows:
        t = row["tflops"]
        cudnn = t.get("sdpa_cudnn")
        ratio = f"{t['flash_cuda'] / cudnn:.3f}x" if cudnn else "-"
        print(f"{row['case']} | {t['flash_cuda']:.1f} | "
              f"{cudnn or float('nan'):.1f} | {t.get('sdpa_flash') or float('nan'):.1f} | {ratio}")
    for note in dict.fromkeys(notes):
        print("note:", note)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": bench_attn.environment(), "rows": rows,
                       "notes": list(dict.fromkeys(notes))}, f, indent=1)


if __name__ == "__main__":
    main()
