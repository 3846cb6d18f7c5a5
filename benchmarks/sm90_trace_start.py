"""Where a tile's start goes in the Hopper forward, per consumer warp group (a diagnostic build).

benchmarks/sm90_trace_start.patch (against commit 0ecd0e1) stamps clock64 on each consumer warp
group's leader from the Q barrier's release to its first S = Q K^T done: the tile's Work and
consume()'s call, the set-up (with the key tiles a warp group skips), the first K's wait, the
first turn, the first S's issue and its wait; summed per warp group in shared memory, printed
(`TSTART block wg ...`) when the block ends.

    git apply benchmarks/sm90_trace_start.patch
    FLASH_CUDA_ARCHS=90 FLASH_CUDA_HDIMS=64 FLASH_CUDA_DTYPES=bf16 \\
        FLASH_CUDA_DISABLE_BACKWARD=1 FLASH_CUDA_DISABLE_KVCACHE=1 python setup.py build_ext --inplace
    python benchmarks/sm90_trace_start.py 64:512:1 64:512:0 64:16384:1

Each shape (head dim : seqlen : causal) runs 3 calls on the grid's problem in a child process;
the last call's lines are summarised.
"""

import subprocess
import sys

# The same calls as sm90_trace.py's (3 on the grid's problem for one shape).
from sm90_trace import CHILD  # this directory is the script's sys.path[0]

# The printed sums after the tile count and the count of tiles whose warp group leads the first
# key tile, in order.
NAMES = ["Work + call", "set-up (+ skipped tiles)", "first K wait", "first turn", "first S issue",
         "first S wait", "Q seen -> first S done"]


def main(argv):
    for spec in argv:
        d, s, c = spec.split(":")
        out = subprocess.run([sys.executable, "-c", CHILD, d, s, c], capture_output=True,
                             timeout=200).stdout.decode(errors="replace")
        lines = [line.split() for line in out.splitlines() if line.startswith("TSTART")]
        last = lines[-(len(lines) // 3):]
        per_wg = {}
        for f in last:
            a = per_wg.setdefault(int(f[2]), [0] * 10)
            for i in range(10):
                a[i] += int(f[3 + i])
        print(f"hdim {d} seqlen {s} causal {c == '1'}: mean cycles per tile with a key loop")
        for wg, a in sorted(per_wg.items()):
            n = max(a[0], 1)
            steps = ", ".join(f"{NAMES[i]} {a[2 + i] / n:.0f}" for i in range(7))
            print(f"  wg {wg}: tiles {a[0]}, lead {a[1] / n:.2f} | {steps}")


if __name__ == "__main__":
    main(sys.argv[1:])
