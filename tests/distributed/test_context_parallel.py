"""flash_cuda inside torch's context parallel (ring attention over a process group), forward and
backward, against a float32 reference on the whole sequence (cp_check.py, one process per rank).

- nccl, one GPU per rank: world sizes 1, 2, 4 and 8, each skipped with fewer GPUs.  World size 1
  runs wherever one GPU is: torch still takes its ring path (the per-step lse merge, the
  head-tail reordering under a causal mask), with no exchange.

Two ranks sharing one GPU over gloo are not tested: with torch 2.11 the ring's all-gather of CUDA
tensors over gloo dies with SIGSEGV in gloo's worker thread (gloo::allgather, from
AsyncAllgatherCoalescedWork), with torch's own flash kernels as with flash_cuda's, under either
rotation (benchmarks/NOTES.md entry 71).

Each case is a fresh `python cp_check.py` (its ranks spawned there) under a time limit.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent

CASES = {
    "causal-bf16-d128-gqa": dict(causal=True, dtype="bfloat16", hdim=128, heads_q=4, heads_kv=2,
                                 seqlen=1024),
    "full-fp16-d64": dict(causal=False, dtype="float16", hdim=64, heads_q=4, heads_kv=4,
                          seqlen=1024),
    # 1008 = 16 x 63: shards of 63 tokens at 8 ranks, no multiple of any tile.  (torch's context
    # parallel needs the length to split into 2 x world equal chunks under a causal mask.)
    "causal-bf16-d256-s1008": dict(causal=True, dtype="bfloat16", hdim=256, heads_q=2, heads_kv=2,
                                   seqlen=1008),
    "full-bf16-d128-alltoall": dict(causal=False, dtype="bfloat16", hdim=128, heads_q=4,
                                    heads_kv=1, seqlen=768, rotate="alltoall"),
}


def _needs(gpus, case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import flash_cuda
    info = flash_cuda.build_info()
    dtype = {"bfloat16": "bf16", "float16": "fp16"}[case["dtype"]]
    both = set(info["head_dims"]["fwd"]) & set(info["head_dims"]["bwd"])
    if dtype not in info["dtypes"] or not any(h >= case["hdim"] for h in both):
        pytest.skip(f"this build has no {dtype} forward and backward kernels for head dim "
                    f"{case['hdim']}")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs; {torch.cuda.device_count()} visible")


def _run(world, backend, case, tmp_path):
    full = dict(batch=1, seed=0, **case)
    result = tmp_path / "result.json"
    cmd = [sys.executable, str(HERE / "cp_check.py"), str(world), backend, json.dumps(full),
           str(result)]
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")  # NVLink multicast stays off
    # The ranks import the flash_cuda this process imported (an in-place build is on sys.path
    # here through the test's root, not in a script's process started from this directory).
    import flash_cuda
    root = str(Path(flash_cuda.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(result.read_text())
    assert all(r["ran"].values()), ("flash_cuda's ops did not run in the ring", r)
    assert not any(r["nan"].values()), r
    for name, err in r["errors"].items():
        assert err <= r["bounds"][name], (name, r)


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_nccl(world, case, tmp_path):
    _needs(world, CASES[case])
    _run(world, "nccl", CASES[case], tmp_path)
