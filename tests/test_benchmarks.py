"""The benchmark's bookkeeping, without a GPU: how rounds merge and which arguments it rejects."""

import collections
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
