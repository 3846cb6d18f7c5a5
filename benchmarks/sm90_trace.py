"""Where the Hopper forward spends a tile boundary, from clock64 stamps (a diagnostic build).

benchmarks/sm90_trace.patch (against commit f4d67a2) adds per-block stamps to csrc/sm90/
fwd_kernel.cuh: the producer's wait for Q's buffer and its Q issue, each consumer warp group's
wait for the next Q, its first S, its waits for the first K / V of a tile's key loop, its last
P V and the epilogue's steps, summed per warp group in shared memory and printed (one line per
warp group, `TRACE block wg n ...`) when the block ends.  The stamps cost a few registers and
instructions; read the numbers as where the time goes, not as the kernel's speed.

    git apply benchmarks/sm90_trace.patch
    FLASH_CUDA_ARCHS=90 FLASH_CUDA_HDIMS=256 FLASH_CUDA_DTYPES=bf16 \\
        FLASH_CUDA_DISABLE_BACKWARD=1 FLASH_CUDA_DISABLE_KVCACHE=1 python setup.py build_ext --inplace
    python benchmarks/sm90_trace.py 256:512:0 256:512:1 256:1024:0

Each shape (head dim : seqlen : causal) runs in a child process, 3 calls on the grid's problem
(16k tokens, model dim 2048, bf16); the last call's lines are summarised as mean SM cycles per
tile (a block's first tile left out, but from the fields of the key loop, which count per tile
with a key loop).
"""

import subprocess
import sys

CHILD = r'''
import sys, torch, flash_cuda
d, s, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for i in range(3):
    flash_cuda.flash_attn_func(q, k, v, causal=causal)
    torch.cuda.synchronize()
'''

# The printed sums, in order (after block and warp group).
FIELDS = [
    "tiles", "wait for the next Q", "Q issue -> seen", "tiles that waited > 200 cycles",
    "Q issue -> seen, those", "producer's wait for Q's buffer", "last S done -> Q issue",
    "last S done -> epilogue end", "tile period (Q seen -> next Q seen)",
    "producer's wait for O out of V's stages", "Q seen -> wait for the next Q",
    "Q seen -> first S done", "first K wait of the key loop", "first V wait of the key loop",
    "tiles with a key loop", "last S done -> last P V done", "last P V done -> epilogue end",
    "epilogue: row sums (finish)", "epilogue: lse, convert", "epilogue: sync of all consumers",
    "epilogue: stmatrix", "epilogue: fence + warp-group sync", "epilogue: TMA store issue",
    "epilogue: store read wait",
]
PER_LOOP = {11, 12, 13}  # per tile with a key loop; field 4 per waited tile


def summarise(lines):
    tot = [0] * len(FIELDS)
    for fields in lines:
        for i in range(len(FIELDS)):
            tot[i] += int(fields[3 + i])
    out = []
    for i, name in enumerate(FIELDS):
        if i in (0, 3, 14):
            out.append((name, tot[i]))
            continue
        den = tot[3] if i == 4 else tot[14] if i in PER_LOOP else tot[0]
        out.append((name, tot[i] / max(den, 1)))
    return out


def main(argv):
    for spec in argv or ["256:512:0", "256:512:1", "256:1024:0"]:
        d, s, c = spec.split(":")
        run = subprocess.run([sys.executable, "-c", CHILD, d, s, c], capture_output=True,
                             text=True, timeout=300)
        lines = [l.split() for l in run.stdout.splitlines() if l.startswith("TRACE")]
        if not lines:
            print(f"{spec}: no TRACE lines (a build without the patch?)\n{run.stderr[-2000:]}")
            continue
        last = lines[-(len(lines) // 3):]
        print(f"hdim {d} seqlen {s} causal {c == '1'}: {len(last)} warp groups, "
              "mean SM cycles per tile")
        for name, value in summarise(last):
            print(f"  {name:42s} {value:10.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
