"""The benchmark's bookkeeping, without a GPU: how rounds merge and which arguments it rejects."""

import collections
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attn  # noqa: E402


def point(direction, **tflops):
    return bench_attn.Point(direction, 128, False, 512, 32, 16, tflops)


def test_rounds_merge_to_per_backend_medians():
    rounds = [[point("fwd", flash_cuda=1.0, sdpa_flash=None),
               point("bwd", flash_cuda=3.0, sdpa_flash=2.0)],
              [point("fwd", flash_cuda=2.0, sdpa_flash=None),
               point("bwd", flash_cuda=5.0, sdpa_flash=1.0)],
              [point("fwd", flash_cuda=9.0, sdpa_flash=None),
               point("bwd", flash_cuda=4.0, sdpa_flash=None)]]
    fwd, bwd = bench_attn.merge_rounds(rounds)
    # A backend that never ran stays None; the others get medians over the rounds they ran in.
    assert fwd.tflops == {"flash_cuda": 2.0, "sdpa_flash": None}
    assert bwd.tflops == {"flash_cuda": 4.0, "sdpa_flash": 1.5}
    assert bwd.rounds == [r[1].tflops for r in rounds]
    assert bench_attn.ratios(bwd)["flash_cuda/sdpa_flash"] == pytest.approx(4.0 / 1.5)


def test_one_round_is_the_run_itself():
    (merged,) = bench_attn.merge_rounds([[point("fwd", flash_cuda=7.0)]])
    assert merged.tflops == {"flash_cuda": 7.0}


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--seqlens", "0"], ["--hdims", "100"],
                                  ["--backends", "nope"], ["--timer", "nope"]])
def test_bad_arguments_are_rejected_before_the_gpu(argv):
    with pytest.raises(SystemExit):
        bench_attn.parse_args(argv)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7])
def test_turns_balance_who_starts_and_who_follows_whom(count):
    names = [f"b{i}" for i in range(count)]
    turns = [bench_attn.turn_order(names, t) for t in range(2 * count)]
    assert all(sorted(t) == names for t in turns)
    starts = collections.Counter(t[0] for t in turns)
    assert set(starts.values()) == {2}
    follows = collections.Counter((a, b) for t in turns for a, b in zip(t, t[1:]))
    assert len(follows) == count * (count - 1) and len(set(follows.values())) <= 1
    assert bench_attn.turn_order([], 3) == []


def test_a_backend_that_fails_while_timed_leaves_a_gap_not_a_crash(monkeypatch):
    monkeypatch.setattr(bench_attn, "make_call", lambda backend, *args: backend.forward)
    monkeypatch.setattr(bench_attn.torch, "randn", lambda *args, **kwargs: None)
    monkeypatch.setattr(bench_attn.torch.cuda, "empty_cache", lambda: None)

    def timer(calls, first):
        for call in calls.values():
            call()
        return {name: 2.0 for name in calls}

    def broken():
        raise RuntimeError("out of memory")

    backends = {"flash_cuda": bench_attn.Backend("flash_cuda", lambda: None),
                "sdpa_flash": bench_attn.Backend("sdpa_flash", broken)}
    notes = []
    tflops = bench_attn.run_point(backends, (1, 512, 2, 64), False, "fwd", None, timer, notes)
    assert tflops["sdpa_flash"] is None and tflops["flash_cuda"] > 0
    assert len(notes) == 1 and "sdpa_flash fwd hdim=64" in notes[0] and "out of memory" in notes[0]


def test_default_timer_takes_turns():
    assert bench_attn.parse_args([]).timer == "interleaved"


# ---- bench_decode.py -----------------------------------------------------------------------------

import bench_decode  # noqa: E402


@pytest.mark.parametrize("argv", [["--layouts", "dense,0"], ["--layouts", "pages"],
                                  ["--heads", "32/7"], ["--hdims", "100"],
                                  ["--batches", "1"], ["--backends", "nope"],
                                  ["--batches", "0", "--caches", "8"], ["--splits", "0"],
                                  ["--splits", "8", "--backends", "sdpa_cudnn"],
                                  ["--rope", "--backends", "sdpa_cudnn"],
                                  ["--env", "FLASH_CUDA_FAMILY"], ["--env", "PATH=/x"],
                                  ["--env", "FLASH_CUDA_A=1,PATH=/x"],
                                  ["--env", "FLASH_CUDA_FAMILY=sm80", "--backends",
                                   "sdpa_cudnn"]])
def test_decode_bad_arguments_are_rejected_before_the_gpu(argv):
    with pytest.raises(SystemExit):
        bench_decode.parse_args(argv)


def test_decode_points_default_to_the_targets_and_take_a_product():
    args = bench_decode.parse_args([])
    assert bench_decode.points(args) == [(b, 1, k) for b, k in bench_decode.TARGET_POINTS]
    args = bench_decode.parse_args(["--batches", "1,4", "--caches", "1024,8192", "--prefill",
                                    "--heads", "32/8,64"])
    assert bench_decode.points(args)[:4] == [(1, 1, 1024), (1, 1, 8192), (4, 1, 1024),
                                             (4, 1, 8192)]
    assert len(bench_decode.points(args)) == 4 + len(bench_decode.PREFILL_CASES)
    assert args.heads == [(32, 8), (64, 64)]
    assert bench_decode.parse_args(["--splits", "8,32"]).splits == [8, 32]
    assert bench_decode.parse_args(["--rope"]).rope and not bench_decode.parse_args([]).rope
    args = bench_decode.parse_args(["--env", "FLASH_CUDA_FAMILY=sm80",
                                    "--env", "FLASH_CUDA_X=1,FLASH_CUDA_Y=0"])
    assert args.env == ["FLASH_CUDA_FAMILY=sm80", "FLASH_CUDA_X=1,FLASH_CUDA_Y=0"]


def test_decode_byte_and_flop_counts():
    # GQA 32/8, head dim 128, bf16, batch 1, 8k keys: 33.5 MB of K and V.
    assert bench_decode.kv_bytes(1, 8192, 8, 128, 2) == 33_554_432
    # One new token sees every key; a chunk of n sees the cached keys and a causal triangle.
    assert bench_decode.prefill_flops(1, 1, 100, 1, 1) == 4 * 100
    assert bench_decode.prefill_flops(2, 4, 10, 3, 8) == 4 * 2 * 3 * 8 * (4 * 6 + 10)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_decode_paged_cache_holds_the_dense_one(page_size):
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(3, 37, 2, 8, generator=g)
    table, pages = bench_decode.page_table(3, 37, page_size, g)
    assert table.dtype == torch.int32 and sorted(table.flatten().tolist()) == list(range(pages))
    paged = bench_decode.to_paged(dense, table, page_size)
    for b in range(3):
        for r in range(37):
            page = table[b, r // page_size]
            assert torch.equal(paged[page, r % page_size], dense[b, r])


def test_decode_table_ratio_is_against_the_best_peer():
    row = {"batch": 1, "new": 1, "keys": 8, "heads_q": 32, "heads_kv": 8, "hdim": 128,
           "layout": "16", "us": {}, "gbs": {"flash_cuda": 3000.0, "sdpa_cudnn": 2000.0,
                                             "sdpa_flash": 2500.0, "flash_cuda_fwd": 9e3}}
    assert bench_decode.best_peer(row) == 2500.0  # flash_cuda's own paths are not peers
    assert bench_decode.format_table([row], ["flash_cuda", "sdpa_cudnn"]).endswith("1.200x | -")
    row["gbs"]["flash_cuda_dense"] = 3750.0  # timed in the same turns as the paged call
    assert bench_decode.paged_over_dense(row) == 0.8
    assert bench_decode.format_table([row], ["flash_cuda"]).endswith("1.200x | 0.800")


def test_context_parallel_bench_parses_and_reports_without_a_gpu(tmp_path):
    import json

    import bench_context_parallel as cp
    args = cp.parse_args(["--seqlens", "1024,2048", "--heads", "8/2", "--backends",
                          "flash_cuda,sdpa_cudnn"])
    assert (args.heads_q, args.heads_kv, args.seqlens) == (8, 2, [1024, 2048])
    for argv in (["--heads", "6/4"], ["--backends", "nope"], ["--seqlens", "0"],
                 ["--steps", "0"]):
        with pytest.raises(SystemExit):
            cp.parse_args(argv)
    one = {"results": [{"seqlen": 1024, "results": {"flash_cuda": {"ms": 8.0},
                                                    "sdpa_cudnn": {"ms": 10.0}}}]}
    (tmp_path / "one.json").write_text(json.dumps(one))
    rows = [{"seqlen": 1024, "results": {"flash_cuda": {"ms": 5.0, "peak_gib": 1.0},
                                         "sdpa_cudnn": {"error": "RuntimeError: no"}}}]
    cp.efficiency(rows, 2, str(tmp_path / "one.json"))
    assert rows[0]["efficiency"] == {"flash_cuda": pytest.approx(0.8)}
    (tmp_path / "other.json").write_text(json.dumps(dict(one, config={"hdim": 64})))
    with pytest.raises(SystemExit, match="hdim"):
        cp.efficiency(rows, 2, str(tmp_path / "other.json"), {"hdim": 128})
    text = cp.table(rows, ["flash_cuda", "sdpa_cudnn"], 2, True)
    assert "1k | 5.0 | - | 1.0 | - | - | 0.80 | -" in text


def test_ncu_stalls_splits_the_sass_at_wgmma_waits():
    import ncu_stalls
    head = '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_wait",' \
           '"stall_wait (Not Issued)"'
    rows = ['"0","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ","2","0","2","1"',
            '"1","WARPGROUP.DEPBAR.LE gsb0, 0x0","10","9","1","1"',
            '"2","MUFU.EX2 R1, R1","1,000","0","1000","0"',
            '"3","HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR4], R24","3","0","3","0"',
            '"4","WARPGROUP.DEPBAR.LE gsb0, 0x1","5","5","0","0"',
            '"5","EXIT","0","0","0","0"']
    text = "==PROF== preamble\n" + "\n".join([head] + rows) + "\n"
    s = ncu_stalls.summarise(text, top=2)
    assert s["instructions"] == 6 and s["samples"] == 1020
    assert [(t["first"], t["last"], t["samples"], t["hgmma"]) for t in s["stretches"]] == \
        [(0, 1, 12, 1), (2, 4, 1008, 1), (5, 5, 0, 0)]
    # Not-issued columns are a subset of the samples, not a reason of their own.
    assert dict(s["by_reason"]) == {"stall_wait": 1006, "stall_barrier": 14}
    assert [i for i, _, _ in s["hottest"]] == [2, 1]
    with pytest.raises(ValueError, match="source page"):
        ncu_stalls.summarise('"a","b"\n"1","2"\n')


def test_sm90_trace_means_are_per_tile_per_loop_and_per_waited_tile():
    import sm90_trace
    n = len(sm90_trace.FIELDS)
    # Two warp groups: 3 + 1 tiles, of which 2 waited, 4 + 0 key loops.
    a = [10 * (i + 1) for i in range(n)]
    a[0], a[3], a[14] = 3, 2, 4
    b = [0] * n
    b[0], b[1], b[14] = 1, 40, 0
    lines = [["TRACE", "0", "0"] + [str(x) for x in a], ["TRACE", "0", "1"] + [str(x) for x in b]]
    out = dict(sm90_trace.summarise(lines))
    assert len(out) == n
    assert out["tiles"] == 4 and out["tiles with a key loop"] == 4
    assert out["wait for the next Q"] == pytest.approx((20 + 40) / 4)  # per tile
    assert out["Q issue -> seen, those"] == pytest.approx(50 / 2)  # per tile that waited
    assert out["Q seen -> first S done"] == pytest.approx(120 / 4)  # per key loop
    assert out["epilogue: store read wait"] == pytest.approx(240 / 4)


def test_ab_prepares_revisions_and_summarises_runs(tmp_path):
    import json
    import subprocess as sp
    import ab
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    sp.run(["git", "init", "-q"], cwd=repo, check=True)
    (repo / "benchmarks" / "results").mkdir(parents=True)
    (repo / "benchmarks" / "results" / "big.json").write_text("{}")
    (repo / "kernel.cu").write_text("v1")
    sp.run(git + ["add", "."], cwd=repo, check=True)
    sp.run(git + ["commit", "-qm", "one"], cwd=repo, check=True)
    (repo / "kernel.cu").write_text("v2")
    sp.run(git + ["commit", "-qam", "two"], cwd=repo, check=True)
    variants = ab.prepare(["base=HEAD~1", "new=HEAD"], tmp_path / "ab", repo=repo)
    assert [v["name"] for v in variants] == ["base", "new"]
    assert (tmp_path / "ab" / "base" / "kernel.cu").read_text() == "v1"
    assert (tmp_path / "ab" / "new" / "kernel.cu").read_text() == "v2"
    assert not (tmp_path / "ab" / "new" / "benchmarks" / "results").exists()
    assert json.loads((tmp_path / "ab" / "variants.json").read_text()) == variants
    with pytest.raises(ValueError, match="NAME=REV"):
        ab.prepare(["HEAD"], tmp_path / "ab", repo=repo)

    def result(seqlen, mine, peer):
        return {"direction": "fwd", "hdim": 128, "causal": False, "seqlen": seqlen,
                "tflops": {"flash_cuda": mine, "sdpa_cudnn": peer}}
    runs = [("base", {"results": [result(512, 400.0, 500.0), result(2048, 600.0, 600.0)]}),
            ("new", {"results": [result(512, 450.0, 500.0), result(2048, None, 600.0)]})]
    lines = ab.summarise(runs)
    assert lines[1].split("|")[1:] == [" 0.800 (400/500) ", " 0.900 (450/500)"]
    assert lines[2].split("|")[2] == " -"
    # Geomeans over the points each run has: sqrt(0.8 * 1.0) and 0.9.
    assert lines[-1].endswith("base 0.894 (2 pts) | new 0.900 (1 pts)")


def test_ab_times_only_the_variants_whose_check_passes(tmp_path):
    import ab
    for name in ("base", "broken", "hangs"):
        (tmp_path / name).mkdir()
    (tmp_path / "broken" / "flag").write_text("")
    cmd = ("if [ -e flag ]; then exit 3; fi; "
           "if [ \"$(basename \"$PWD\")\" = hangs ]; then sleep 30; fi")
    passed = ab.check_variants(["base", "broken", "hangs"], cmd, tmp_path, tmp_path, timeout=2)
    assert passed == ["base"]
    assert (tmp_path / "check_broken.log").exists() and (tmp_path / "check_hangs.log").exists()


def test_ab_run_refuses_a_head_dim_the_model_dim_does_not_hold(tmp_path, capsys):
    import ab
    # Refused before any variant is built (there is none under tmp_path).
    with pytest.raises(SystemExit) as e:
        ab.main(["--ab", str(tmp_path), "run", "--hdims", "64,96"])
    assert e.value.code == 2
    assert "--hdims: 96 must be a positive divisor of --model-dim 2048" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--ab", str(tmp_path), "run", "--hdims", "x"])
