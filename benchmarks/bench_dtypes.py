"""The forward's fp16 speed against its bf16 speed, both timed in one run, with cuDNN's alike.

Separate runs of bench_attn.py (`--dtype bf16`, then `--dtype fp16`) drift by a few percent
between them, cuDNN included; here the four calls of a point (flash_cuda and sdpa_cudnn, each
in bf16 and fp16, on fresh random inputs of the grid's shapes: 16k tokens, model dim 2048) are
timed in turns with bench_attn.py's timer, so each ratio fp16 / bf16 comes from one run.

    python benchmarks/bench_dtypes.py [--hdims 64,128,256] [--json PATH]
"""

import argparse
import json
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import bench_attn
import flash_cuda

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPES = (("bf16", torch.bfloat16), ("fp16", torch.float16))


def point_calls(hdim, seqlen, causal):
    batch, heads = 16384 // seqlen, 2048 // hdim
    calls = {}
    for name, dtype in DTYPES:
        q, k, v = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=dtype)
                   for _ in range(3))
        calls["flash_cuda_" + name] = (
            lambda q=q, k=k, v=v: flash_cuda.flash_attn_func(q, k, v, causal=causal))

        def cudnn(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2)):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        calls["sdpa_cudnn_" + name] = cudnn
    for call in calls.values():
        call()  # a point a backend cannot run fails here, before any timing
    return batch, heads, calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hdims", default="64,128,256")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    print(f"device: {torch.cuda.get_device_name()}")
    print("hdim causal seqlen | flash_cuda bf16  fp16  fp16/bf16 | sdpa_cudnn fp16/bf16")
    for hdim in (int(h) for h in args.hdims.split(",")):
        for causal in (False, True):
            for seqlen in SEQLENS:
                batch, heads, calls = point_calls(hdim, seqlen, causal)
                ms = bench_attn.time_in_turns(calls, 25, 100)
                flops = bench_attn.attention_flops(batch, heads, seqlen, hdim, causal, "fwd")
                tflops = {name: flops / (t * 1e9) for name, t in ms.items()}
                row = dict(hdim=hdim, causal=causal, seqlen=seqlen, tflops=tflops,
                           flash_cuda=tflops["flash_cuda_fp16"] / tflops["flash_cuda_bf16"],
                           sdpa_cudnn=tflops["sdpa_cudnn_fp16"] / tflops["sdpa_cudnn_bf16"])
                rows.append(row)
                print(f"{hdim:4d} {'yes' if causal else 'no':>6s} {seqlen:6d} | "
                      f"{tflops['flash_cuda_bf16']:15.1f} {tflops['flash_cuda_fp16']:5.1f} "
                      f"{row['flash_cuda']:10.3f} | {row['sdpa_cudnn']:20.3f}", flush=True)
    ratios = [r["flash_cuda"] for r in rows]
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"flash_cuda fp16 / bf16: geomean {geomean:.3f}, lowest {min(ratios):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
