"""csrc/manifest.py: the build knobs select the right kernels and the generator writes one
translation unit per kernel plus the tables the dispatcher and build_info() read."""

import pytest


def test_defaults_cover_the_whole_manifest(manifest):
    archs, hdims, dtypes, directions = manifest.parse_knobs({})
    assert archs == sorted(manifest.DEFAULT_ARCHS)
    assert hdims == manifest.HEAD_DIMS
    assert set(dtypes) == set(manifest.DTYPES)
    assert directions == ("fwd", "bwd", "fwd_kvcache")


def test_detected_gpu_sets_the_default_arch(manifest):
    assert manifest.parse_knobs({}, detected_archs=[90])[0] == [90]


def test_knobs_filter(manifest):
    env = {"FLASH_CUDA_ARCHS": "90a;80", "FLASH_CUDA_HDIMS": "128,64", "FLASH_CUDA_DTYPES": "bf16",
           "FLASH_CUDA_DISABLE_BACKWARD": "1"}
    archs, hdims, dtypes, directions = manifest.parse_knobs(env)
    assert archs == [80, 90] and hdims == (64, 128)
    assert dtypes == ("bf16",) and directions == ("fwd", "fwd_kvcache")
    selected = manifest.select(archs, hdims, dtypes, directions)
    names = sorted(k.name for k in selected["sm80"][1])
    assert names == ["fwd_kvcache_sm80_bf16_hdim128", "fwd_kvcache_sm80_bf16_hdim64",
                     "fwd_sm80_bf16_hdim128", "fwd_sm80_bf16_hdim64"]
    env["FLASH_CUDA_DISABLE_KVCACHE"] = "1"
    assert manifest.parse_knobs(env)[3] == ("fwd",)
    assert sorted(k.name for k in selected["sm90"][1]) == [
        "fwd_kvcache_sm90_bf16_hdim128", "fwd_kvcache_sm90_bf16_hdim64",
        "fwd_sm90_bf16_hdim128", "fwd_sm90_bf16_hdim64"]


def test_families_select_their_archs_and_ops(manifest):
    """sm90 serves 9.x with forward kernels only; the portable family serves every arch."""
    selected = manifest.select([80, 90], (64,), ("bf16",), ("fwd", "bwd"))
    assert list(selected) == ["sm90", "sm80"], "preference order"
    assert selected["sm90"][0] == [90] and selected["sm80"][0] == [80, 90]
    assert {k.direction for k in selected["sm90"][1]} == {"fwd"}
    assert list(manifest.select([80], (64,), ("bf16",), ("fwd",))) == ["sm80"]
    assert manifest.PORTABLE_FAMILY == list(manifest.FAMILIES)[-1]


def test_gencode_flags(manifest):
    """Arch-specific code (sm_90a) ships as machine code only; the portable family adds PTX of
    its newest arch for later GPUs."""
    assert manifest.gencode_flags("sm90", [90]) == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert manifest.targets("sm80", [80, 90]) == ["sm_80", "sm_90", "compute_90"]
    assert manifest.targets("sm90", [90]) == ["sm_90a"]


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
    assert len(sources["sm80"]) == 4 and len(sources["sm90"]) == 2
    unit = (tmp_path / "bwd_sm80_fp16_hdim128.cu").read_text()
    assert "run_bwd<flash_cuda::half_t, 128>" in unit
    assert "bwd_workspace_bytes<flash_cuda::half_t, 128>" in unit
    assert "fwd_supports<flash_cuda::half_t, 64>" in (tmp_path / "fwd_sm90_fp16_hdim64.cu").read_text()
    for op, families in (("fwd", ["kSm90", "kSm90", "kSm80", "kSm80"]), ("bwd", ["kSm80"] * 2)):
        table = (tmp_path / f"{op}_kernel_table.inc").read_text()
        entries = [l for l in table.splitlines() if l.startswith(f"FLASH_CUDA_{op.upper()}_KERNEL(")]
        assert [l.split("(")[1].split(",")[0] for l in entries] == families, table
        assert all("kFloat16" in l for l in entries), table
    families = (tmp_path / "family_table.inc").read_text().splitlines()
    assert families[-2:] == ['FLASH_CUDA_FAMILY(kSm90, "sm90", 90, 100, true, 90)',
                             'FLASH_CUDA_FAMILY(kSm80, "sm80", 80, 1000, false, 90)']
    info = (tmp_path / "build_info.inc").read_text()
    assert "FLASH_CUDA_BUILD_ARCHS {90}" in info
    assert '{"sm90", "sm_90a", 90, 100, "fwd"}' in info
    assert '{"sm80", "sm_90 compute_90", 80, 1000, "fwd bwd"}' in info
    before = (tmp_path / "fwd_kernel_table.inc").stat().st_mtime_ns
    manifest.generate(str(tmp_path), [90], selected)
    assert (tmp_path / "fwd_kernel_table.inc").stat().st_mtime_ns == before, \
        "unchanged files are kept"
