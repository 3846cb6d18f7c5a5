"""Runs one attention forward and backward, for a profiler to capture.

    ncu --kernel-name regex:"fwd_kernel|bwd_kernel" python benchmarks/profile_one.py --hdim 128
    ncu --kernel-name regex:flash_ python benchmarks/profile_one.py --backend sdpa_flash

The second profiles the peer (FlashAttention-2 inside PyTorch) on the same problem.
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
    parser.add_argument("--backend", choices=["flash_cuda", "sdpa_flash"], default="flash_cuda")
    args = parser.parse_args()
    batch, heads = args.tokens // args.seqlen, args.model_dim // args.hdim
    shape = (batch, args.seqlen, heads, args.hdim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if args.backend == "flash_cuda":
        out = flash_attn_func(q, k, v, causal=args.causal)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=args.causal).transpose(1, 2)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"{args.backend}: ran fwd+bwd for {shape}, causal={args.causal}")


if __name__ == "__main__":
    main()
