"""Where a kernel's warps wait, from Nsight Compute's stall sampling, per SASS instruction and per
stretch of code between wgmma waits.

    ncu --clock-control none --section SourceCounters --section WarpStateStats \\
        -k regex:fwd_kernel -c 1 -o fwd python benchmarks/profile_one.py --hdim 128 --seqlen 512
    ncu -i fwd.ncu-rep --page source --csv --print-source sass > fwd.csv
    python benchmarks/ncu_stalls.py fwd.csv

Prints the samples by stall reason, the instructions with the most samples, and the samples of
each stretch of SASS that ends at a `WARPGROUP.DEPBAR` (a wgmma wait) or at the end of the code,
so that a tile's first key tile, the loop and the epilogue of the Hopper forward can be told
apart (benchmarks/NOTES.md entry 51).
"""

import argparse
import csv
import io
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(text: str):
    """(header, rows) of the source page: the first row that names the SASS column and the
    sample count is the header; rows of another width (ncu's preamble) are dropped."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if start is None:
        raise ValueError(f"no header with 'Source' and '{SAMPLES}': not ncu's source page as CSV "
                         "(ncu -i REPORT --page source --csv --print-source sass)")
    header = rows[start]
    return header, [r for r in rows[start + 1:] if len(r) == len(header)]


def summarise(text: str, top: int = 20) -> dict:
    header, rows = read(text)
    src, samples = header.index("Source"), header.index(SAMPLES)
    reasons = [i for i, name in enumerate(header)
               if name.startswith("stall_") and "(Not Issued)" not in name]
    total = sum(_number(r[samples]) for r in rows)
    by_reason = Counter()
    for r in rows:
        for i in reasons:
            by_reason[header[i]] += _number(r[i])
    order = sorted(range(len(rows)), key=lambda i: -_number(rows[i][samples]))[:top]
    hottest = [(i, _number(rows[i][samples]), rows[i][src].strip()) for i in order]
    # Stretches of code, each closed by a wgmma wait (or the end).
    stretches, first, acc, gemms = [], 0, 0.0, 0
    for i, r in enumerate(rows):
        acc += _number(r[samples])
        gemms += "HGMMA" in r[src]
        if "WARPGROUP.DEPBAR" in r[src] or i == len(rows) - 1:
            stretches.append(dict(first=first, last=i, samples=acc, hgmma=gemms,
                                  end=r[src].strip()))
            first, acc, gemms = i + 1, 0.0, 0
    return dict(instructions=len(rows), samples=total, by_reason=by_reason.most_common(),
                hottest=hottest, stretches=stretches)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    with open(args.csv, errors="replace") as f:
        s = summarise(f.read(), args.top)
    total = max(s["samples"], 1.0)
    print(f"{s['instructions']} instructions, {s['samples']:.0f} samples")
    print("by reason: " + ", ".join(f"{name} {100 * n / total:.1f}%"
                                    for name, n in s["by_reason"][:8] if n))
    print("stretches of SASS, each ending at a wgmma wait:")
    for t in s["stretches"]:
        print(f"  [{t['first']:5d}, {t['last']:5d}] {100 * t['samples'] / total:5.1f}%  "
              f"{t['hgmma']:3d} HGMMA  ends at {t['end'][:60]}")
    print("hottest instructions:")
    for i, n, text in s["hottest"]:
        print(f"  {i:5d} {100 * n / total:5.1f}%  {text[:80]}")


if __name__ == "__main__":
    main()
