"""Architectures verl trains with Megatron whose shards this reader does not map (``families.MEGATRON_REFUSED``:
megatron-core 0.16 cannot build them on CPU). A ``dist_ckpt`` of one
is refused at plan time in one line naming the architecture and the supported way (the bridge's HF
export), inputs untouched, nothing written; a hybrid save that holds that export merges from it.

The configs are transformers' own for each model type (MiMo's, which transformers does not ship, is its
Hub config); the shards are a real megatron-core sample's, since the refusal must come before they are read.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from merge_pipeline.families import BRIDGE_REFUSED, MEGATRON_REFUSED
from merge_pipeline_samples.megatron import arrange_v2
from merge_pipeline_tests.helpers import assert_bit_exact, merge_error, merge_ok, tree_digest

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MODEL_TYPES = {
    "MiMoForCausalLM": "mimo",
    "Llama4ForConditionalGeneration": "llama4",
    "Llama4ForCausalLM": "llama4_text",
}
# XiaomiMiMo/MiMo-7B-RL's config.json, sizes shrunk: model_type "mimo" is remote code.
MIMO_CONFIG = {
    **TINY,
    "architectures": ["MiMoForCausalLM"],
    "model_type": "mimo",
    "auto_map": {
        "AutoConfig": "configuration_mimo.MiMoConfig",
        "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
    },
    "attention_bias": True,
    "intermediate_size": 96,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 640000,
    "tie_word_embeddings": False,
}


def write_config(folder, architecture: str) -> None:
    """transformers' own config.json of the architecture's model type, as a trainer's model folder has it."""
    model_type = MODEL_TYPES[architecture]
    if model_type == "mimo":
        (folder / "config.json").write_text(json.dumps(MIMO_CONFIG))
        return
    config = transformers.AutoConfig.for_model(model_type)
    config.architectures = [architecture]
    config.save_pretrained(folder)


def test_every_refused_architecture_is_tested():
    """The bridge's architectures refused for what the bridge itself cannot do on CPU (``BRIDGE_REFUSED``) are
    checked one by one in ``test_bridge_account.py``."""
    assert set(MODEL_TYPES) == set(MEGATRON_REFUSED) - set(BRIDGE_REFUSED)


@pytest.mark.parametrize("architecture", sorted(MODEL_TYPES))
def test_dist_checkpoint_of_a_refused_architecture_is_one_line(fresh_megatron, tmp_path, capsys, architecture):
    role = fresh_megatron("qwen2_tp2").role_dir
    write_config(role / "huggingface", architecture)
    before = tree_digest(role)
    line = merge_error(capsys, role, tmp_path / "out", "--backend", "auto")
    assert line.startswith(f"error: {role / 'huggingface' / 'config.json'}: {architecture} ("), line
    assert MEGATRON_REFUSED[architecture] in line and "use_mbridge=True" in line and "hf_model" in line, line
    assert tree_digest(role) == before


def test_an_architecture_no_family_has_names_the_bridge_too(fresh_megatron, tmp_path, capsys):
    role = fresh_megatron("qwen2_tp2").role_dir
    config = json.loads((role / "huggingface" / "config.json").read_text())
    (role / "huggingface" / "config.json").write_text(json.dumps({**config, "architectures": ["PhiForCausalLM"]}))
    line = merge_error(capsys, role, tmp_path / "out")
    assert "unsupported architecture PhiForCausalLM for Megatron checkpoints" in line and "use_mbridge" in line, line


def test_hybrid_save_of_a_refused_architecture_merges_the_bridge_export(megatron_samples, tmp_path, capsys):
    """verl's hybrid mode (bridge + ``use_dist_checkpointing``, ``hf_model`` saved): shards in
    ``model/dist_ckpt/`` and the bridge's HF export in ``model/huggingface/``. For Llama 4 the export is
    what merges, bit for bit (a real tiny Llama4ForCausalLM saved by transformers)."""
    sample = arrange_v2(megatron_samples["qwen2_tp2"], tmp_path / "global_step_1" / "actor", "hybrid")
    hf_dir = sample.role_dir / "model" / "huggingface"
    for path in hf_dir.glob("*.safetensors"):
        path.unlink()
    config = transformers.Llama4TextConfig(
        **TINY, intermediate_size=32, intermediate_size_mlp=64, head_dim=16, num_local_experts=4
    )
    config.architectures = ["Llama4ForCausalLM"]
    torch.manual_seed(0)
    transformers.Llama4ForCausalLM(config).save_pretrained(tmp_path / "export")
    shutil.copytree(tmp_path / "export", hf_dir, dirs_exist_ok=True)
    merge_ok(capsys, sample.role_dir, tmp_path / "out")
    assert_bit_exact(tmp_path / "out", tmp_path / "export")
