"""Checkpoints written through Megatron-Bridge 0.6.2 on megatron-core 0.18.2 themselves: rank 0 saves a
small transformers Llama / Qwen3, two gloo ranks load it with ``AutoBridge.from_hf_pretrained`` and the
bridge's own model provider (TP=2, megatron-core's local layer spec: the TransformerEngine spec's names are
``test_bridge_architectures.py``'s), and save what verl's ``MegatronCheckpointManager`` saves with the
bridge: megatron-core's ``dist_checkpointing.save`` into ``model/dist_ckpt/`` and the bridge's
``save_hf_weights`` into ``model/huggingface/``, and with the bridge's LoRA its ``save_hf_adapter`` into
``model/huggingface/adapter/``. Each layout merges from the CLI with ``--backend auto``
bit for bit into what the bridge's own ``export_hf_weights`` gives: so our Megatron-to-HF mapping
equals the bridge's.

The bridge runs in its own venv (``scripts/setup_bridge.sh``, called by ``scripts/setup.sh``); the
writer is ``merge_pipeline_samples/megatron_bridge_save.py``, which says what stands in on CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from merge_pipeline_tests.helpers import assert_bit_exact, run_cli, write_with_release

pytestmark = pytest.mark.slow

FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="module")
def bridge_saves(tmp_path_factory) -> Path:
    """``<root>/<family>/{actor/model/{dist_ckpt,huggingface}, expected/model.safetensors, hf/}``."""
    return write_with_release(
        ".venv-bridge", "megatron_bridge_save.py", tmp_path_factory.mktemp("megatron_bridge"), "--family", *FAMILIES
    )


def _merge(capsys, role: Path, out: Path, *flags) -> dict:
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", role, "--target_dir", out, "--backend", "auto", "--no-progress", *flags
    )
    assert code == 0, err
    return json.loads((out / "merge_manifest.json").read_text())["source"]


@pytest.mark.parametrize("family", FAMILIES)
def test_dist_ckpt_merges_as_the_bridges_own_export(capsys, tmp_path, bridge_saves, family):
    """``use_dist_checkpointing=True`` without the bridge's HF files: the shards, mapped by our names,
    equal ``export_hf_weights`` bit for bit; config from ``--hf_model_path``."""
    saved = bridge_saves / family
    role = tmp_path / "actor"
    shutil.copytree(saved / "actor" / "model" / "dist_ckpt", role / "model" / "dist_ckpt")
    source = _merge(capsys, role, tmp_path / "out", "--hf_model_path", saved / "hf")
    assert source["backend"] == "megatron" and len(source["inputs"]) == 2  # one .distcp per TP rank
    assert_bit_exact(tmp_path / "out", saved / "expected")
    architecture = json.loads((saved / "hf" / "config.json").read_text())["architectures"][0]
    _, info = getattr(transformers, architecture).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_reads_the_shards_and_equals_the_export(capsys, tmp_path, bridge_saves, family):
    """Both trees, as verl writes them with the bridge and ``use_dist_checkpointing=True``."""
    saved = bridge_saves / family
    source = _merge(capsys, saved / "actor", tmp_path / "out")
    assert source["inputs"][0]["path"].endswith(".distcp")
    assert_bit_exact(tmp_path / "out", saved / "expected")


def test_save_hf_weights_folder_is_copied_as_the_export(capsys, tmp_path, bridge_saves):
    """verl's default with the bridge: only ``model/huggingface/`` (``save_hf_weights``) and an empty
    ``model/dist_ckpt/``."""
    saved = bridge_saves / "qwen3"
    role = tmp_path / "actor"
    (role / "model" / "dist_ckpt").mkdir(parents=True)
    shutil.copytree(saved / "actor" / "model" / "huggingface", role / "model" / "huggingface")
    source = _merge(capsys, role, tmp_path / "out")
    assert source["inputs"][0]["path"].endswith("huggingface/model.safetensors"), source["inputs"]
    assert_bit_exact(tmp_path / "out", saved / "expected")


def test_lora_adapter_export_is_kept_and_folds_as_the_bridges_merge(capsys, tmp_path, bridge_saves):
    """verl with the bridge and LoRA: ``save_hf_adapter`` wrote ``model/huggingface/adapter/`` and no
    base weights. With ``--hf_model_path`` the output is the base plus the bridge's adapter, bit for
    bit; with ``--merge-lora`` the folded weights equal the bridge's own merged export
    (``export_hf_weights(merge_adapter_weights=True)``) bit for bit."""
    saved = bridge_saves / "llama"
    role = saved / "lora" / "actor"
    _merge(capsys, role, tmp_path / "out", "--hf_model_path", saved / "hf")
    assert_bit_exact(tmp_path / "out", saved / "hf")  # LoRA leaves the base unchanged
    assert_bit_exact(tmp_path / "out" / "lora_adapter", role / "model" / "huggingface" / "adapter")

    _merge(capsys, role, tmp_path / "folded", "--hf_model_path", saved / "hf", "--merge-lora")
    assert_bit_exact(tmp_path / "folded", saved / "lora" / "expected_merged")
