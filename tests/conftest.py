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

    def runs(target):  # dispatch's rule (runs_on in csrc/dispatch/dispatch.cpp)
        kind, _, number = target.partition("_")
        if number.endswith("a"):  # arch-specific machine code: that arch only
            return int(number[:-1]) == arch
        n = int(number)
        return n <= arch and (kind == "compute" or n // 10 == major)

    return [name for name in info["families"]
            if info["family_info"][name]["serves"][0] <= arch < info["family_info"][name]["serves"][1]
            and any(runs(t) for t in info["family_info"][name]["targets"])]


def first_error_line(call):
    """(exception type name, first line of its message) that call() raises, or None: what the
    tests comparing two implementations' checks compare."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001  (the type is compared too)
        return type(exc).__name__, str(exc).split("\n")[0]
    return None


def real_and_fake_errors(op, args):
    """first_error_line of op(**args) on the tensors of `args` and on fake copies of them (what
    torch.compile meets): the real kernel's checks and the fake kernel's, on the same call."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = first_error_line(lambda: op(**args))
    with FakeTensorMode() as mode:
        fake_args = {n: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                     for n, a in args.items()}
        fake = first_error_line(lambda: op(**fake_args))
    return real, fake


def skip_unless_built(dtype, head_dim, directions=("fwd", "bwd")):
    """Skip, naming the knob, where this build holds no kernel for `dtype` at a head dim >= `head_dim`
    in one of `directions` (a FLASH_CUDA_DTYPES / FLASH_CUDA_HDIMS subset build); a full build
    holds them all, so there the test runs."""
    import torch
    import flash_cuda
    info = flash_cuda.build_info()
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    if name not in info["dtypes"]:
        pytest.skip(f"this build has no {name} kernels (FLASH_CUDA_DTYPES)")
    for direction in directions:
        if not any(d >= head_dim for d in info["head_dims"].get(direction, [])):
            pytest.skip(f"this build has no {direction} kernel for head dim {head_dim} "
                        "(FLASH_CUDA_HDIMS)")


def pytest_generate_tests(metafunc):
    if "kernel_family" in metafunc.fixturenames:
        metafunc.parametrize("kernel_family", kernel_families() or ["none"], indirect=True)


@pytest.fixture
def kernel_family(request, monkeypatch):
    """FLASH_CUDA_FAMILY names the family and FLASH_CUDA_FAMILY_STRICT=1 makes a decline by it an
    error, so that a test of `[sm90]` cannot pass on the portable family's kernels."""
    if request.param != "none":
        monkeypatch.setenv("FLASH_CUDA_FAMILY", request.param)
        monkeypatch.setenv("FLASH_CUDA_FAMILY_STRICT", "1")
    return request.param


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: quick subset for routine GPU runs (under a minute)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped when none is visible")
