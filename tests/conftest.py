"""Shared pytest configuration: the markers that select subsets of the suite.

`fast` marks the tests worth running on every GPU change (under a minute in all); `cuda` marks
tests that need a CUDA device and skip without one.
The `manifest` fixture loads csrc/manifest.py (not a package) for the tests that check the
build's declared kernels against what the code and the docs say.
"""

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def manifest():
    path = Path(__file__).resolve().parents[1] / "csrc" / "manifest.py"
    spec = importlib.util.spec_from_file_location("flash_cuda_manifest", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: quick subset for routine GPU runs (under a minute)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when none is visible")
