"""Each architecture in ``families.MEGATRON_PROVEN`` built through Megatron-Bridge 0.6.2 itself and saved as verl
saves it: a tiny transformers model of the architecture, loaded by the bridge's own model provider on two
gloo ranks (tensor parallel 2; expert parallel 2 where the family has experts), megatron-core's
``dist_checkpointing.save`` of its sharded state dict. The CLI merge (``--backend auto``) of those shards
equals the bridge's own ``export_hf_weights`` of the same model bit for bit, and transformers loads the
merged folder with nothing missing or unexpected.

One ``.venv-bridge`` process writes every architecture (``merge_pipeline_samples/megatron_bridge_archs.py``,
which says what stands in for what on CPU: TransformerEngine's modules by ``merge_pipeline_samples/te_stand_in/``),
once per venv: the folder is cached in ``.venv-bridge/fixtures/`` under its stamp and the writer's sources."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from merge_pipeline import families
from merge_pipeline_tests.helpers import assert_bit_exact, cached_release_fixture, run_cli

pytestmark = pytest.mark.slow

PROVEN = sorted(families.MEGATRON_PROVEN)
WRITER = (
    "merge_pipeline_samples/megatron_bridge_archs.py",
    "merge_pipeline_samples/megatron_bridge_save.py",
    "merge_pipeline_samples/gloo_ranks.py",
    "merge_pipeline_samples/te_stand_in",
)


@pytest.fixture(scope="module")
def bridge_saves() -> Path:
    """``<root>/<architecture>/{hf/, actor/model/dist_ckpt/, expected/model.safetensors}``."""
    return cached_release_fixture(".venv-bridge", "megatron_bridge_archs.py", *PROVEN, sources=WRITER, timeout=3600)


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
