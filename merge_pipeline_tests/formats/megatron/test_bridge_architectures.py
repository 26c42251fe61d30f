"""Each architecture in ``families.MEGATRON_PROVEN`` built through Megatron-Bridge 0.6.2 itself and saved as verl
saves it: a tiny transformers model of the architecture, loaded by the bridge's own model provider on two
gloo ranks (tensor parallel 2; expert parallel 2 where the family has experts), megatron-core's
``dist_checkpointing.save`` of its sharded state dict. The CLI merge (``--backend auto``) of those shards
equals the bridge's own ``export_hf_weights`` of the same model bit for bit, and transformers loads the
merged folder with nothing missing or unexpected.

One ``.venv-bridge`` process writes every architecture (``merge_pipeline_samples/megatron_bridge_archs.py``,
which says what stands in for what on CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from merge_pipeline import families
from merge_pipeline_tests.helpers import assert_bit_exact, run_cli, write_with_release

pytestmark = pytest.mark.slow

PROVEN = sorted(families.MEGATRON_PROVEN)


@pytest.fixture(scope="module")
def bridge_saves(tmp_path_factory) -> Path:
    """``<root>/<architecture>/{hf/, actor/model/dist_ckpt/, expected/model.safetensors}``."""
    root = tmp_path_factory.mktemp("bridge_architectures")
    return write_with_release(".venv-bridge", "megatron_bridge_archs.py", root, *PROVEN, timeout=1800)


@pytest.mark.parametrize("architecture", PROVEN)
def test_merge_equals_the_bridges_export(capsys, tmp_path, bridge_saves, architecture):
    saved = bridge_saves / architecture
    assert not (saved / "failed.txt").exists(), (saved / "failed.txt").read_text()
    assert (saved / "layout.txt").read_text().strip() == families.MEGATRON_PROVEN[architecture]
    role = tmp_path / "actor"
    shutil.copytree(saved / "actor" / "model" / "dist_ckpt", role / "model" / "dist_ckpt")
    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        role,
        "--target_dir",
        tmp_path / "out",
        "--backend",
        "auto",
        "--no-progress",
        "--hf_model_path",
        saved / "hf",
    )
    assert code == 0, err
    source = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())["source"]
    assert source["backend"] == "megatron" and len(source["inputs"]) == 2  # one .distcp per rank
    assert_bit_exact(tmp_path / "out", saved / "expected")
    _, info = getattr(transformers, architecture).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
