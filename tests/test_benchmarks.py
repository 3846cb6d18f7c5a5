"""The benchmark's bookkeeping, without a GPU: how rounds merge and which arguments it rejects."""

import sys
from pathlib import Path

import pytest

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


def test_turns_rotate_so_each_backend_starts_equally_often():
    names = ["flash_cuda", "sdpa_flash", "sdpa_cudnn"]
    turns = [bench_attn.turn_order(names, t) for t in range(6)]
    assert all(sorted(t) == sorted(names) for t in turns)
    assert [t[0] for t in turns] == names + names
    assert bench_attn.turn_order([], 3) == []


def test_default_timer_takes_turns():
    assert bench_attn.parse_args([]).timer == "interleaved"
