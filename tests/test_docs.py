"""The docs stay true: every file csrc/README.md names exists, every tile config the kernels
need is declared, and the README's head-dim list is the manifest's."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_files_named_in_csrc_readme_exist():
    text = (ROOT / "csrc" / "README.md").read_text()
    names = set(re.findall(r"`((?:ops|dispatch|sm80|common)/[\w.]+|manifest\.py)`", text))
    assert names, "the layer table names files"
    for name in names:
        assert (ROOT / "csrc" / name).exists(), f"csrc/README.md names {name}, which is gone"


def test_every_manifest_head_dim_has_tile_configs(manifest):
    config = (ROOT / "csrc" / "sm80" / "tile_config.h").read_text()
    for hdim in manifest.HEAD_DIMS:
        for kind in ("Fwd", "Bwd"):
            assert f"struct {kind}TileConfig<{hdim}>" in config, f"no {kind}TileConfig<{hdim}>"


def test_readme_head_dims_match_manifest(manifest):
    text = (ROOT / "README.md").read_text()
    line = next(l for l in text.splitlines() if l.startswith("| head dims"))
    listed = [int(x) for x in re.findall(r"\b(\d+)\b", line.split("compiled:")[1].split(";")[0])]
    assert tuple(listed) == manifest.HEAD_DIMS


def test_readme_lists_every_build_knob():
    """Every FLASH_CUDA_* knob setup.py reads is in the README's knob table, and no other."""
    knobs = set()
    for path in (ROOT / "setup.py", ROOT / "csrc" / "manifest.py"):
        knobs |= set(re.findall(r"\"(FLASH_CUDA_[A-Z_]+)\"", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = {m for m in re.findall(r"^\| `(FLASH_CUDA_\w+)` \|", readme, re.M)}
    assert knobs and knobs == table, (sorted(knobs), sorted(table))


def test_readme_names_the_transformers_attention():
    hf = pytest.importorskip("flash_cuda.integrations.transformers")
    readme = (ROOT / "README.md").read_text()
    assert f'"{hf.NAME}"' in readme and "flash" not in hf.NAME
