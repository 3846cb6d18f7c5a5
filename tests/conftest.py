"""Shared pytest configuration: the markers that select subsets of the suite.

`fast` marks the tests worth running on every GPU change (under a minute in all); `cuda` marks
tests that need a CUDA device and skip without one.
The `manifest` and `toolchain` fixtures load csrc/manifest.py and csrc/toolchain.py (not a
package) for the tests of the build: its declared kernels against the code and the docs, and its
compiler checks.
"""

import importlib.util
from pathlib import Path

import pytest


def _load_csrc_module(name):
    path = Path(__file__).resolve().parents[1] / "csrc" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"flash_cuda_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def manifest():
    return _load_csrc_module("manifest")


@pytest.fixture(scope="session")
def toolchain():
    return _load_csrc_module("toolchain")


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: quick subset for routine GPU runs (under a minute)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when none is visible")
