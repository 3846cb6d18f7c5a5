"""examples/decode_loop.py: prefill and greedy decode over a paged KV cache give the tokens that
the whole sequence through flash_attn_func gives (CPU reference; on a GPU also as a captured
CUDA graph)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from conftest import skip_unless_built


def _decode_loop():
    path = Path(__file__).resolve().parents[1] / "examples" / "decode_loop.py"
    spec = importlib.util.spec_from_file_location("decode_loop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_loop_matches_the_full_sequence_on_cpu():
    generated = _decode_loop().main(["--steps", "12", "--prompt", "9", "--device", "cpu"])
    assert generated.shape == (2, 12)


def test_a_wrong_cache_fails_the_check(monkeypatch):
    """The check can fail: with the appended keys dropped, tokens diverge."""
    loop = _decode_loop()
    real = loop.cached_attention

    def forgetful(model, cache):
        attend = real(model, cache)

        def without_new_keys(layer, q, k, v):
            return attend(layer, q, torch.zeros_like(k), v)
        return without_new_keys

    monkeypatch.setattr(loop, "cached_attention", forgetful)
    with pytest.raises(SystemExit, match="disagree"):
        loop.main(["--steps", "12", "--prompt", "9", "--device", "cpu"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph", [True, False], ids=["graph", "eager"])
def test_decode_loop_on_cuda(graph):
    skip_unless_built(torch.float16, 16, directions=("fwd", "fwd_kvcache"))
    _decode_loop().main(["--steps", "64", "--device", "cuda"] + ([] if graph else ["--no-graph"]))
