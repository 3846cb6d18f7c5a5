"""The build: which archs the knobs select, the compiler checks of csrc/toolchain.py, and that the
extension formats numbers in its messages (Note [One C++ runtime])."""

import os
import shutil
import stat
import sys

import pytest

import flash_cuda

@pytest.mark.fast
def test_check_messages_format_numbers():
    """A failed TORCH_CHECK that streams a double and an integer: crashed the process (or printed
    nothing) when the extension carried its own copy of the C++ runtime."""
    assert flash_cuda._C._check_message_with_numbers(0.5, 42) == "formatted 0.5 and 42"
    assert flash_cuda._C._check_message_with_numbers(float("inf"), -1) == "formatted inf and -1"


@pytest.mark.parametrize("env, archs, source", [
    ({}, [80, 90], "the default"),
    ({"TORCH_CUDA_ARCH_LIST": "8.0 9.0+PTX"}, [80, 90], "TORCH_CUDA_ARCH_LIST"),
    ({"TORCH_CUDA_ARCH_LIST": "9.0a;10.0"}, [90, 100], "TORCH_CUDA_ARCH_LIST"),
    ({"TORCH_CUDA_ARCH_LIST": "8.6", "FLASH_CUDA_ARCHS": "90"}, [90], "FLASH_CUDA_ARCHS"),
    ({"TORCH_CUDA_ARCH_LIST": " "}, [80, 90], "the default"),
])
def test_arch_precedence(manifest, env, archs, source):
    """FLASH_CUDA_ARCHS, then TORCH_CUDA_ARCH_LIST, then the visible GPUs, then 80;90."""
    assert manifest.parse_archs(env) == (archs, source)


def test_each_family_unit_gets_its_own_gencode(toolchain, tmp_path):
    """torch writes one cuda_post_cflags for all units; PerUnitFlags gives the sm90 units a
    binding of their own with the family's gencode in place of the portable one's."""
    portable = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=compute_90"]
    sm90_unit = str(tmp_path / "fwd_sm90_bf16_hdim64.cu")
    ninja = tmp_path / "build.ninja"
    ninja.write_text(
        "cuda_post_cflags = -O3 " + " ".join(portable) + " -DX\n"
        f"build a.o: cuda_compile {tmp_path / 'fwd_sm80_bf16_hdim64.cu'}\n"
        f"build b.o: cuda_compile {sm90_unit}\n")
    flags = toolchain.PerUnitFlags(portable, {sm90_unit: ["-gencode=arch=compute_90a,code=sm_90a"]})
    flags.rewrite(str(ninja))
    lines = ninja.read_text().splitlines()
    assert lines[1].startswith("build a.o") and lines[2].startswith("build b.o")
    assert lines[3] == "  cuda_post_cflags = -O3 -gencode=arch=compute_90a,code=sm_90a -DX"
    with pytest.raises(RuntimeError, match="found 0 of the 1 units"):
        toolchain.PerUnitFlags(portable, {"/elsewhere.cu": ["-x"]}).rewrite(str(ninja))


def test_per_unit_flags_through_torchs_own_ninja_writer(toolchain, tmp_path, monkeypatch):
    """The rewrite on the file torch 2.11's writer produces, for sources whose path holds a
    space (ninja escapes it): a change in torch's format fails here, in CI, not on a user's
    machine."""
    from torch.utils import cpp_extension
    monkeypatch.setattr(cpp_extension, "_write_ninja_file", cpp_extension._write_ninja_file)
    monkeypatch.setattr(cpp_extension, "get_cxx_compiler", lambda: "c++", raising=False)
    portable = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=compute_90"]
    src = tmp_path / "with space"
    src.mkdir()
    units = [str(src / "fwd_sm80_bf16_hdim64.cu"), str(src / "fwd_sm90_bf16_hdim64.cu")]
    flags = toolchain.PerUnitFlags(portable, {units[1]: ["-gencode=arch=compute_90a,code=sm_90a"]})
    flags.install()
    ninja = tmp_path / "build.ninja"
    cpp_extension._write_ninja_file(
        path=str(ninja), cflags=["-O3"], post_cflags=[], cuda_cflags=[],
        cuda_post_cflags=["-O3"] + portable, cuda_dlink_post_cflags=None, sycl_cflags=None,
        sycl_post_cflags=None, sycl_dlink_post_cflags=None, sources=units,
        objects=[str(tmp_path / "a.o"), str(tmp_path / "b.o")], ldflags=None,
        library_target=None, with_cuda=True, with_sycl=False)
    flags.check_rewritten()
    text = ninja.read_text()
    sm90 = text[text.index("fwd_sm90_bf16_hdim64.cu"):]
    assert "  cuda_post_cflags = " in sm90 and "code=sm_90a" in sm90
    assert "code=sm_80" not in sm90.split("\n")[1]
    sm80 = text[text.index("fwd_sm80_bf16_hdim64.cu"):text.index("fwd_sm90_bf16_hdim64.cu")]
    assert "sm_90a" not in sm80


def test_per_unit_flags_need_ninja(toolchain):
    """Without ninja torch compiles every unit with one flag list: the build must stop."""
    flags = toolchain.PerUnitFlags(["-g80"], {"/x/fwd_sm90.cu": ["-g90a"]})
    with pytest.raises(RuntimeError, match="ninja"):
        flags.check_backend(use_ninja=False)
    with pytest.raises(RuntimeError, match="compiled without them"):
        flags.check_rewritten()
    toolchain.PerUnitFlags(["-g80"], {}).check_backend(use_ninja=False)  # nothing to give


def test_visible_gpus_come_after_the_knobs(manifest):
    assert manifest.parse_archs({}, detected_archs=[86]) == ([86], "the visible GPUs")
    assert manifest.parse_archs({"TORCH_CUDA_ARCH_LIST": "9.0"}, [86])[0] == [90]


def test_bad_arch_names_the_knob(manifest):
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST entry 'Hopper'"):
        manifest.parse_archs({"TORCH_CUDA_ARCH_LIST": "Hopper"})


def test_cuda_major_mismatch_is_a_clear_error(toolchain):
    toolchain.check_cuda_versions("/usr/local/cuda/bin/nvcc", "13.0", "13.0")
    with pytest.raises(RuntimeError, match=r"CUDA 12\.8, but this torch was built for CUDA 13\.0"):
        toolchain.check_cuda_versions("/opt/cuda-12.8/bin/nvcc", "12.8", "13.0")


def _system_cxx():
    return shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(_system_cxx() is None, reason="needs a C++ compiler")
def test_probe_accepts_the_system_compiler(toolchain):
    ok, detail = toolchain.probe_cxx(_system_cxx())
    assert ok, detail


def _static_runtime_wrapper(tmp_path):
    """A 'compiler' that links libstdc++ statically into shared libraries, as a foreign GCC
    toolchain did on the CUDA image."""
    wrapper = tmp_path / "g++-static-runtime"
    wrapper.write_text(f"#!/bin/sh\nexec {_system_cxx()} \"$@\" -static-libstdc++\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)


@pytest.mark.skipif(_system_cxx() is None, reason="needs a C++ compiler")
def test_probe_rejects_a_compiler_that_links_its_own_runtime(toolchain, tmp_path):
    ok, detail = toolchain.probe_cxx(_static_runtime_wrapper(tmp_path))
    assert not ok and "formats numbers wrongly beside torch" in detail


@pytest.mark.skipif(_system_cxx() is None, reason="needs a C++ compiler")
def test_a_bad_cxx_is_replaced_by_the_system_compiler(toolchain, tmp_path):
    env = {"CXX": _static_runtime_wrapper(tmp_path), "CC": "/nonexistent/gcc"}
    lines = []
    chosen = toolchain.check_cxx_runtime(env, lines.append)
    assert os.path.realpath(chosen) == os.path.realpath(_system_cxx())
    assert env["CXX"] == chosen and env.get("CC") != "/nonexistent/gcc"
    assert len(lines) == 1 and "links its own copy of the C++ runtime" in lines[0]


@pytest.mark.skipif(_system_cxx() is None, reason="needs a C++ compiler")
def test_no_good_compiler_stops_the_build(toolchain, tmp_path, monkeypatch):
    bad = _static_runtime_wrapper(tmp_path)
    monkeypatch.setattr(toolchain, "_fallback_compilers", lambda: [])  # nothing to fall back to
    with pytest.raises(RuntimeError, match=r"no C\+\+ compiler here links extensions"):
        toolchain.check_cxx_runtime({"CXX": bad}, print, python=sys.executable)


def test_no_nvcc_means_a_build_without_cuda_kernels(toolchain, tmp_path):
    """setup.py builds the op layer only when the toolkit has no nvcc (cuda_toolkit -> None)."""
    assert toolchain.cuda_toolkit(None) is None
    assert toolchain.cuda_toolkit(str(tmp_path)) is None  # a CUDA_HOME without bin/nvcc


@pytest.mark.skipif(_system_cxx() is None, reason="needs a C++ compiler")
def test_a_missing_cxx_says_so(toolchain):
    env = {"CXX": "/nonexistent/g++"}
    lines = []
    toolchain.check_cxx_runtime(env, lines.append)
    assert "cannot build the extension" in lines[0] and "could not be run" in lines[0]


def test_wrapped_cxx_is_split_like_a_shell(toolchain, tmp_path):
    """CXX="ccache g++"-style commands (and quoted paths) reach the probe as argv, not one word."""
    ok, detail = toolchain.probe_cxx(f"env '{_system_cxx()}'")
    assert ok, detail
