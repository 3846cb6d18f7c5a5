"""Runs one attention forward and backward with flash_cuda, for a profiler to capture.

    ncu --kernel-name regex:"fwd_kernel|bwd_kernel" python benchmarks/profile_one.py --hdim 128
"""

import argparse

import torch

from flash_cuda import flash_attn_func


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hdim", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--model-dim", type=int, default=2048)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    batch, heads = args.tokens // args.seqlen, args.model_dim // args.hdim
    shape = (batch, args.seqlen, heads, args.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    out = flash_attn_func(q, k, v, causal=args.causal)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"ran fwd+bwd for {shape}, causal={args.causal}")


if __name__ == "__main__":
    main()
