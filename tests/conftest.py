"""Shared pytest configuration: the markers that select subsets of the suite.

`fast` marks the tests worth running on every GPU change (under a minute in all); `cuda` marks
tests that need a CUDA device and skip without one.
The `kernel_family` fixture runs a test once per compiled kernel family that this machine's GPU
can run (FLASH_CUDA_FAMILY set for the test; a family without a kernel for an op falls back to
the portable one, as in production).  The `manifest` and `toolchain` fixtures load csrc/manifest.py and csrc/toolchain.py (not a
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


def kernel_families():
    """The compiled families the visible GPU runs, in preference order; [] without one."""
    try:
        import torch
        if not torch.cuda.is_available():
            return []
        import flash_cuda
        info = flash_cuda.build_info()
    except (ImportError, RuntimeError):
        return []
    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    runnable = []
    for name in info["families"]:
        family = info["family_info"][name]
        lo, hi = family["serves"]
        # Arch-specific code (sm_90a) runs on that arch only; other code by its PTX too.
        specific = [t for t in family["targets"] if t.endswith("a")]
        if lo <= arch < hi and (not specific or f"sm_{arch}a" in specific):
            runnable.append(name)
    return runnable


def pytest_generate_tests(metafunc):
    if "kernel_family" in metafunc.fixturenames:
        metafunc.parametrize("kernel_family", kernel_families() or ["none"], indirect=True)


@pytest.fixture
def kernel_family(request, monkeypatch):
    if request.param != "none":
        monkeypatch.setenv("FLASH_CUDA_FAMILY", request.param)
    return request.param


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: quick subset for routine GPU runs (under a minute)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when none is visible")
