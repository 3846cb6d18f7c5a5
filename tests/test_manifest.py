"""csrc/manifest.py: the build knobs select the right kernels and the generator writes one
translation unit per kernel plus the tables the dispatcher and build_info() read."""

import pytest


def test_defaults_cover_the_whole_manifest(manifest):
    archs, hdims, dtypes, directions = manifest.parse_knobs({})
    assert archs == sorted(manifest.DEFAULT_ARCHS)
    assert hdims == manifest.HEAD_DIMS
    assert set(dtypes) == set(manifest.DTYPES) and directions == ("fwd", "bwd")


def test_detected_gpu_sets_the_default_arch(manifest):
    assert manifest.parse_knobs({}, detected_archs=[90])[0] == [90]


def test_knobs_filter(manifest):
    env = {"FLASH_CUDA_ARCHS": "90a;80", "FLASH_CUDA_HDIMS": "128,64", "FLASH_CUDA_DTYPES": "bf16",
           "FLASH_CUDA_DISABLE_BACKWARD": "1"}
    archs, hdims, dtypes, directions = manifest.parse_knobs(env)
    assert archs == [80, 90] and hdims == (64, 128)
    assert dtypes == ("bf16",) and directions == ("fwd",)
    selected = manifest.select(archs, hdims, dtypes, directions)
    names = sorted(k.name for k in selected["sm80"][1])
    assert names == ["fwd_sm80_bf16_hdim128", "fwd_sm80_bf16_hdim64"]


@pytest.mark.parametrize("env, word", [({"FLASH_CUDA_HDIMS": "72"}, "FLASH_CUDA_HDIMS"),
                                       ({"FLASH_CUDA_DTYPES": "fp8"}, "FLASH_CUDA_DTYPES")])
def test_unknown_knob_values_are_rejected(manifest, env, word):
    with pytest.raises(ValueError, match=word):
        manifest.parse_knobs(env)


def test_no_family_below_sm80(manifest):
    assert manifest.select([75], manifest.HEAD_DIMS, ("bf16",), ("fwd",)) == {}


def test_generate_writes_units_and_tables(manifest, tmp_path):
    selected = manifest.select([90], (64, 128), ("fp16",), ("fwd", "bwd"))
    sources = manifest.generate(str(tmp_path), [90], selected)
    assert len(sources["sm80"]) == 4
    unit = (tmp_path / "bwd_sm80_fp16_hdim128.cu").read_text()
    assert "run_bwd<flash_cuda::half_t, 128>" in unit
    assert "bwd_workspace_bytes<flash_cuda::half_t, 128>" in unit
    for op in ("fwd", "bwd"):
        table = (tmp_path / f"{op}_kernel_table.inc").read_text()
        entries = [l for l in table.splitlines() if l.startswith(f"FLASH_CUDA_{op.upper()}_KERNEL(")]
        assert len(entries) == 2 and all("kSm80, kFloat16" in l for l in entries), table
    families = (tmp_path / "family_table.inc").read_text()
    assert 'FLASH_CUDA_FAMILY(kSm80, "sm80", 80, 1000, 90)' in families
    assert "FLASH_CUDA_BUILD_ARCHS {90}" in (tmp_path / "build_info.inc").read_text()
    before = (tmp_path / "fwd_kernel_table.inc").stat().st_mtime_ns
    manifest.generate(str(tmp_path), [90], selected)
    assert (tmp_path / "fwd_kernel_table.inc").stat().st_mtime_ns == before, \
        "unchanged files are kept"
