"""Greedy decoding with flash_cuda's KV-cache API: a small randomly initialised transformer
(rotary embeddings, GQA) fills a paged KV cache with its prompt, then generates token by token
through flash_attn_with_kvcache, each step appending its key and value in place; on a GPU the
decode step runs as a captured CUDA graph replayed with new cache lengths.  At the end the whole
sequence runs once more through flash_attn_func, and the greedy token of every position must
match the one generated.

Run:
    python examples/decode_loop.py                 # CUDA if available, else the CPU reference
    python examples/decode_loop.py --steps 64 --device cuda --no-graph
"""

import argparse
import math

import torch

from flash_cuda import flash_attn_func, flash_attn_with_kvcache


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=97, dim=128, layers=2, heads=8, heads_kv=2, max_len=512, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, dim // heads

        def param(*shape, scale):
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.embed = param(vocab, dim, scale=1.0)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.wq = param(dim, heads * self.head_dim, scale=dim ** -0.5)
            layer.wk = param(dim, heads_kv * self.head_dim, scale=dim ** -0.5)
            layer.wv = param(dim, heads_kv * self.head_dim, scale=dim ** -0.5)
            layer.wo = param(heads * self.head_dim, dim, scale=dim ** -0.5)
            layer.w1 = param(dim, 4 * dim, scale=dim ** -0.5)
            layer.w2 = param(4 * dim, dim, scale=(4 * dim) ** -0.5)
            self.layers.append(layer)
        self.unembed = param(dim, vocab, scale=dim ** -0.5)
        # Rotary tables (half-split layout), positions 0 .. max_len - 1.
        freqs = 10000.0 ** (-torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.arange(max_len).float()[:, None] * freqs[None]
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def rotate(self, x, positions):
        """Half-split rotary of x (batch, seqlen, heads, head_dim) at `positions` (seqlen,)."""
        half = self.head_dim // 2
        c, s = self.cos[positions][None, :, None], self.sin[positions][None, :, None]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)

    @staticmethod
    def norm(x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def forward(self, tokens, attend):
        """tokens (batch, n) -> logits (batch, n, vocab); attend(layer, q, k, v) -> attention out
        for q (batch, n, heads, d) and the n new (unrotated) k, v (batch, n, heads_kv, d)."""
        b, n = tokens.shape
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            h = self.norm(x)
            q = (h @ layer.wq).view(b, n, self.heads, self.head_dim)
            k = (h @ layer.wk).view(b, n, self.heads_kv, self.head_dim)
            v = (h @ layer.wv).view(b, n, self.heads_kv, self.head_dim)
            x = x + attend(i, q, k, v).reshape(b, n, -1) @ layer.wo
            x = x + torch.relu(self.norm(x) @ layer.w1) @ layer.w2
        return self.norm(x) @ self.unembed


class PagedCache:
    """One paged K and V cache per layer, pages handed out in a random order."""

    def __init__(self, model, batch, capacity, page_size, dtype, device, seed=0):
        per_seq = -(-capacity // page_size)
        g = torch.Generator().manual_seed(seed)
        self.page_table = torch.randperm(batch * per_seq, generator=g).to(
            torch.int32).view(batch, per_seq).to(device)
        shape = (batch * per_seq, page_size, model.heads_kv, model.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in model.layers]
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)


def cached_attention(model, cache):
    """attend() over the cache: appends the new keys (rotated inside the call) at cache.lengths."""
    def attend(layer, q, k, v):
        return flash_attn_with_kvcache(
            q, cache.k[layer], cache.v[layer], k, v, rotary_cos=model.cos.to(q.dtype),
            rotary_sin=model.sin.to(q.dtype), cache_seqlens=cache.lengths,
            page_table=cache.page_table, causal=True, rotary_interleaved=False)
    return attend


def full_attention(model):
    """attend() over the whole sequence at once, rotary applied here."""
    def attend(layer, q, k, v):
        positions = torch.arange(q.shape[1], device=q.device)
        return flash_attn_func(model.rotate(q, positions), model.rotate(k, positions), v,
                               causal=True)
    return attend


def generate(model, prompt, steps, page_size=16, use_graph=True):
    """Greedy tokens after `prompt` (batch, n): the prompt fills the cache, then one token per
    step (a CUDA graph of the step, replayed, where use_graph and on CUDA)."""
    batch, n = prompt.shape
    cache = PagedCache(model, batch, n + steps, page_size, model.embed.dtype, prompt.device)
    attend = cached_attention(model, cache)
    with torch.no_grad():
        logits = model(prompt, attend)
        cache.lengths += n
        token = logits[:, -1].argmax(-1, keepdim=True)
        out = [token]
        static_token = token.clone()

        def step():
            logits = model(static_token, attend)
            return logits[:, -1].argmax(-1, keepdim=True)

        graph = None
        if use_graph and prompt.is_cuda:
            # Warm up on a side stream (as torch.cuda.graph expects), then capture one step; the
            # warm-up's appends are overwritten by the replays, which write the same rows.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_next = step()
        for _ in range(steps - 1):
            if graph is not None:
                graph.replay()
                token = static_next.clone()
            else:
                token = step()
            cache.lengths += 1
            static_token.copy_(token)
            out.append(token)
    return torch.cat(out, dim=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=23, help="prompt length")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-graph", action="store_true")
    args = parser.parse_args(argv)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model = TinyLM(max_len=args.prompt + args.steps + 1).to(args.device, dtype)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (args.batch, args.prompt), generator=g).to(args.device)
    generated = generate(model, prompt, args.steps, args.page_size, not args.no_graph)
    # Teacher-forced check: the whole sequence through flash_attn_func, greedy at every position.
    sequence = torch.cat([prompt, generated], dim=1)
    with torch.no_grad():
        logits = model(sequence[:, :-1], full_attention(model))
    expected = logits[:, args.prompt - 1:].argmax(-1)
    same = (expected == generated).float().mean().item()
    print(f"{args.steps} steps x batch {args.batch} on {args.device}"
          f"{' (CUDA graph)' if args.device == 'cuda' and not args.no_graph else ''}: "
          f"{same * 100:.1f}% of the generated tokens match flash_attn_func's")
    if same < 1.0:
        raise SystemExit("the KV-cache decode and the full-sequence attention disagree")
    return generated


if __name__ == "__main__":
    main()
