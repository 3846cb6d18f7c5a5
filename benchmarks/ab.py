"""A/B of kernel versions on one GPU: builds of several git revisions side by side, timed one
after the other in one session (the first once more at the end, to show the drift), each as
flash_cuda / a peer per point (benchmarks/NOTES.md's way of comparing a change).

    python benchmarks/ab.py prepare base=main new=HEAD   # where git is: ab/base, ab/new
    FLASH_CUDA_ARCHS=90 FLASH_CUDA_HDIMS="64;128;256" FLASH_CUDA_DTYPES=bf16 \\
        FLASH_CUDA_DISABLE_BACKWARD=1 FLASH_CUDA_DISABLE_KVCACHE=1 MAX_JOBS=16 \\
        python benchmarks/ab.py run --hdims 64,128,256 --seqlens 512,2048,16384 --out ab/out

`prepare` writes each revision's sources (`git archive`) to ab/NAME and the list to
ab/variants.json, so that `run` needs no git (the GPU machine may have none: carry `ab`).
`run` builds every variant in its own directory at once (the build knobs of the environment,
MAX_JOBS shared between them), runs `--check CMD` in each (tests of a new kernel, under a time
limit: a variant that fails or hangs is not timed), then times each with this checkout's
bench_attn.py, the variant first on the import path, and prints the ratio table; ab/out/NAME.json
holds the raw numbers.  Head dims that do not divide 2048 (96, 192) need `--model-dim`, e.g.
1536: checked before anything is built.
"""

import argparse
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_attn.py"


def prepare(pairs, ab_dir: Path, repo: Path = ROOT) -> list:
    """Writes the sources of each NAME=REV to ab_dir/NAME; returns (and saves) the variants."""
    variants = []
    ab_dir.mkdir(parents=True, exist_ok=True)
    for pair in pairs:
        name, sep, rev = pair.partition("=")
        if not sep or not name or not rev or "/" in name:
            raise ValueError(f"expected NAME=REV with a plain NAME, got {pair!r}")
        commit = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=repo,
                                check=True, capture_output=True, text=True).stdout.strip()
        archive = subprocess.run(["git", "archive", commit], cwd=repo, check=True,
                                 capture_output=True).stdout
        dest = ab_dir / name
        if dest.exists():
            shutil.rmtree(dest)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            members = [m for m in tar.getmembers()
                       if not m.name.startswith("benchmarks/results")]
            # The "data" filter (Python 3.12, and 3.8.17+ backports) refuses links out of dest.
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(dest, members=members, **safe)
        variants.append(dict(name=name, rev=rev, commit=commit))
    (ab_dir / "variants.json").write_text(json.dumps(variants, indent=1) + "\n")
    return variants


def summarise(runs, peer="sdpa_cudnn"):
    """Lines of the table: per point, each run's flash_cuda / peer (and both TFLOP/s); then the
    geomeans. `runs` is a list of (name, bench_attn JSON) in the order to print."""
    key = lambda r: (r.get("direction", "fwd"), r["hdim"], r["causal"], r["seqlen"])
    points = [key(r) for r in runs[0][1]["results"]]
    logs = {name: [] for name, _ in runs}
    lines = ["dir hdim causal seqlen | " + " | ".join(f"{n} (TFLOP/s)" for n, _ in runs)]
    for point in points:
        cells = []
        for name, data in runs:
            r = next((r for r in data["results"] if key(r) == point), None)
            mine = r["tflops"].get("flash_cuda") if r else None
            theirs = r["tflops"].get(peer) if r else None
            if mine and theirs:
                logs[name].append(math.log(mine / theirs))
                cells.append(f"{mine / theirs:.3f} ({mine:.0f}/{theirs:.0f})")
            else:
                cells.append("-")
        d, h, c, s = point
        lines.append(f"{d} {h:4d} {'yes' if c else 'no':>5s} {s:6d} | " + " | ".join(cells))
    lines.append(f"geomean flash_cuda/{peer} | " + " | ".join(
        f"{n} {math.exp(sum(v) / len(v)):.3f} ({len(v)} pts)" if v else f"{n} -"
        for n, v in logs.items()))
    return lines


def check_variants(names, cmd, ab_dir: Path, out: Path, timeout: float) -> list:
    """Runs `cmd` in each variant's directory (a new kernel can be wrong or hang), each under
    `timeout` seconds, its output in out/check_NAME.log; returns the names that passed."""
    passed = []
    for name in names:
        with open(out / f"check_{name}.log", "w") as log:
            # Its own process group, so that a hung check is killed whole (a hung kernel left
            # running would skew every timing after it).
            proc = subprocess.Popen(cmd, shell=True, cwd=ab_dir / name, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
        print(f"check {name}: rc={rc}", flush=True)
        if rc == 0:
            passed.append(name)
    return passed


def run(args) -> int:
    ab_dir = Path(args.ab)
    variants = json.loads((ab_dir / "variants.json").read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = max(1, int(os.environ.get("MAX_JOBS", os.cpu_count() or 1)) // len(variants))
    builds = []
    for v in variants:
        env = dict(os.environ, MAX_JOBS=str(jobs))
        log = open(out / f"build_{v['name']}.log", "w")
        builds.append((v, log, subprocess.Popen(
            [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ab_dir / v["name"],
            env=env, stdout=log, stderr=subprocess.STDOUT)))
    failed = False
    for v, log, proc in builds:
        rc = proc.wait()
        log.close()
        print(f"build {v['name']} ({v['commit'][:10]}): rc={rc}", flush=True)
        failed |= rc != 0
    if failed:
        return 1
    names = [v["name"] for v in variants]
    if args.check:
        names = check_variants(names, args.check, ab_dir, out, args.check_timeout)
        if not names or names[0] != variants[0]["name"]:
            return 1
    order = names + [names[0]]
    runs = []
    for i, name in enumerate(order):
        label = name if i < len(names) else name + "-again"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str((ab_dir / name).resolve())] + [p for p in [env.get("PYTHONPATH")] if p])
        cmd = [sys.executable, str(BENCH), "--direction", args.direction, "--hdims", args.hdims,
               "--seqlens", args.seqlens, "--backends", "flash_cuda," + args.peer,
               "--model-dim", str(args.model_dim), "--json", str(out / f"{label}.json")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        (out / f"bench_{label}.log").write_text(proc.stdout + proc.stderr)
        print(f"bench {label}: rc={proc.returncode}", flush=True)
        if proc.returncode != 0:
            return 1
        runs.append((label, json.loads((out / f"{label}.json").read_text())))
    print("\n".join(summarise(runs, args.peer)))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ab", default=str(ROOT / "ab"), help="where the variants live")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write the sources of NAME=REV ... (first: the base)")
    p.add_argument("pairs", nargs="+", metavar="NAME=REV")
    r = sub.add_parser("run", help="build every prepared variant, time each, print the table")
    r.add_argument("--direction", choices=["fwd", "bwd", "both"], default="fwd")
    r.add_argument("--hdims", default="64,128,256")
    r.add_argument("--seqlens", default="512,2048,16384")
    r.add_argument("--peer", default="sdpa_cudnn")
    r.add_argument("--model-dim", type=int, default=2048,
                   help="heads * head dim, as bench_attn.py's (every head dim must divide it)")
    r.add_argument("--out", default=str(ROOT / "ab" / "out"))
    r.add_argument("--check", metavar="CMD",
                   help="a shell command run in each variant's directory before any timing; "
                        "variants where it fails are not timed (the whole run stops if the "
                        "base fails)")
    r.add_argument("--check-timeout", type=float, default=300.0, metavar="S",
                   help="seconds each check may take before it counts as failed")
    args = parser.parse_args(argv)
    if args.command == "run":
        # Checked before any build: bench_attn.py would refuse it only after them.
        for hdim in args.hdims.split(","):
            if not hdim.strip().isdigit() or int(hdim) <= 0 or args.model_dim % int(hdim):
                parser.error(f"--hdims: {hdim.strip()} must be a positive divisor of "
                             f"--model-dim {args.model_dim} (e.g. --model-dim 1536 for 96)")
    if args.command == "prepare":
        for v in prepare(args.pairs, Path(args.ab)):
            print(f"{v['name']}: {v['rev']} = {v['commit']}")
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
