"""Layouts verl 0.9 writes besides the plain FSDP role folder: LoRA-only rank files, meshes named and
placed by other engines (VeOmni's dp_shard, FSDP x TP), the SFT trainer's step folder and the
NeMo-Automodel engine's consolidated HF folder. All written by real torch / transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.distributed.tensor.placement_types import _StridedShard

from merge_pipeline.formats import checkpoint_name
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_samples.fsdp import FsdpSpec, write_nemo_automodel_checkpoint
from merge_pipeline_tests.helpers import (
    assert_bit_exact,
    load_safetensors_dir,
    merge_error,
    merge_ok,
    same_bits,
    tree_digest,
)

LORA_ONLY = FsdpSpec(lora=(4, 8), lora_only=True)
TP_GRID = FsdpSpec(world_size=4, mesh=(2, 2), dim_names=("dp_shard", "tp"), placements=("S0", "S1"))
MESHES = {
    "veomni-dp_shard-ws3": FsdpSpec(world_size=3, dim_names=("dp_shard",)),
    "hsdp-dp_replicate-dp_shard": FsdpSpec(world_size=4, mesh=(2, 2), dim_names=("dp_replicate", "dp_shard")),
    "fsdp-x-tp-shard0-shard1": TP_GRID,
    "shard0-on-both-mesh-dims": FsdpSpec(
        world_size=4, mesh=(2, 2), dim_names=("dp_shard", "tp"), placements=("S0", "S0")
    ),
}
SFT = FsdpSpec(layout="sft")
TOKENS = torch.tensor([[1, 5, 17, 1002, 40]])


# --- checkpoint.save_lora_only ---------------------------------------------------------------------


def base_model(sample):
    """The model training started from: the HF folder verl's model.path names."""
    return transformers.AutoModelForCausalLM.from_pretrained(sample.reference_dir / "base").eval()


def trained_model(sample):
    """The PEFT model as it was trained: base plus the trained LoRA weights, from the reference."""
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base_model(sample), lora)
    model.load_state_dict(load_file(sample.reference_dir / "model.safetensors"), strict=True)
    return model.eval()


def test_lora_only_rank_files_hold_only_lora_tensors(fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA_ONLY)
    for rank in range(2):
        state = torch.load(
            sample.role_dir / f"model_world_size_2_rank_{rank}.pt", map_location="meta", weights_only=True
        )
        assert state and all(".lora_A." in name or ".lora_B." in name for name in state)


def test_lora_only_becomes_a_peft_adapter_folder(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA_ONLY)
    out = tmp_path / "adapter"
    merge_ok(capsys, sample.role_dir, out)

    source = sample.role_dir / "huggingface"
    side_files = {p.name for p in source.iterdir()} - {"config.json"}
    assert {p.name for p in out.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        MANIFEST,
    } | side_files
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["task_type"]) == (4, 8, "CAUSAL_LM")
    assert sorted(adapter_config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    # PEFT's saved names: no ".default" adapter name
    reference = load_file(sample.reference_dir / "model.safetensors")
    expected = {name.replace(".default.", "."): tensor for name, tensor in reference.items() if ".lora_" in name}
    assert_bit_exact(load_file(out / "adapter_model.safetensors"), expected)

    loaded = peft.PeftModel.from_pretrained(base_model(sample), out).eval()
    parameters = dict(loaded.named_parameters())
    for name, tensor in reference.items():
        assert same_bits(parameters[name].detach(), tensor), name
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, trained_model(sample)(TOKENS).logits)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == transformers.AutoTokenizer.from_pretrained(source).get_vocab()


def test_lora_only_with_hf_model_path_writes_base_weights_and_adapter(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA_ONLY)
    out = tmp_path / "full"
    merge_ok(capsys, sample.role_dir, out, "--hf-model-path", sample.reference_dir / "base")

    assert_bit_exact(load_safetensors_dir(out), load_file(sample.reference_dir / "base" / "model.safetensors"))
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(out), out / "lora_adapter"
    ).eval()
    parameters = dict(loaded.named_parameters())
    for name, tensor in load_file(sample.reference_dir / "model.safetensors").items():
        assert same_bits(parameters[name].detach(), tensor), name
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["options"]["hf_model_path"] == str(sample.reference_dir / "base")
    assert str(sample.reference_dir / "base" / "model.safetensors") in [i["path"] for i in manifest["source"]["inputs"]]


def test_lora_only_merge_lora_with_hf_model_path_equals_peft_merge(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA_ONLY)
    merge_ok(
        capsys, sample.role_dir, tmp_path / "merged", "--hf_model_path", sample.reference_dir / "base", "--merge-lora"
    )
    merge_ok(capsys, sample.role_dir, tmp_path / "adapter")

    expected = peft.PeftModel.from_pretrained(base_model(sample), tmp_path / "adapter").merge_and_unload().state_dict()
    assert not (tmp_path / "merged" / "lora_adapter").exists()
    assert_bit_exact(load_safetensors_dir(tmp_path / "merged"), expected)


def test_lora_only_merge_lora_without_base_names_hf_model_path(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA_ONLY)
    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--merge-lora")
    assert str(sample.role_dir) in line and "only LoRA tensors" in line and "--hf_model_path" in line


def test_lora_only_with_the_wrong_base_model_is_one_line(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA_ONLY)
    wrong_base = tmp_path / "wrong_base"
    wrong_base.mkdir()
    weights = load_file(sample.reference_dir / "base" / "model.safetensors")
    weights["model.layers.1.self_attn.v_proj.weight"] = weights["model.layers.1.self_attn.v_proj.weight"][:16].clone()
    save_file(weights, wrong_base / "model.safetensors", metadata={"format": "pt"})
    before = tree_digest(sample.role_dir)

    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", wrong_base)
    assert (
        str(wrong_base / "model.safetensors") in line
        and "model.layers.1.self_attn.v_proj.weight has shape (16, 64)" in line
    )
    assert "not the base model" in line
    assert tree_digest(sample.role_dir) == before


def test_lora_only_with_a_missing_base_folder_is_one_line(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA_ONLY)
    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", tmp_path / "no_such_model")
    assert line == f"error: {tmp_path / 'no_such_model'}: --hf_model_path: does not exist"


# --- meshes by placement ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", MESHES)
def test_meshes_merge_by_placement_whatever_their_names(capsys, tmp_path, fsdp_checkpoint, layout):
    spec = MESHES[layout]
    sample = fsdp_checkpoint(spec)
    merge_ok(capsys, sample.role_dir, tmp_path / "out")

    assert_bit_exact(load_safetensors_dir(tmp_path / "out"), load_file(sample.reference_dir / "model.safetensors"))
    layout_facts = json.loads((tmp_path / "out" / MANIFEST).read_text())["source"]["layout"]
    assert layout_facts["mesh_dim_names"] == list(spec.mesh_dim_names) and layout_facts["mesh_shape"] == list(
        spec.mesh_shape
    )
    if spec.placements:
        codes = {"S0": "S(0)", "S1": "S(1)"}  # str() of Shard(0), Shard(1)
        assert layout_facts["placements"] == [codes[p] for p in spec.placements]  # the embedding's: a 2-D tensor


def test_unsupported_placement_is_one_line_naming_it(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(TP_GRID))
    name = "model.layers.0.self_attn.q_proj.weight"
    for rank in range(4):  # what FSDP2 over a column-wise tensor-parallel weight records
        path = sample.role_dir / f"model_world_size_4_rank_{rank}.pt"
        state = torch.load(path, weights_only=True)
        spec = state[name]._spec
        state[name]._spec = dataclasses.replace(spec, placements=(_StridedShard(0, split_factor=2), spec.placements[1]))
        torch.save(state, path)
    before = tree_digest(sample.role_dir)

    line = merge_error(capsys, sample.role_dir, tmp_path / "out")
    assert str(sample.role_dir / "model_world_size_4_rank_0.pt") in line
    assert f"{name}: unsupported placement _StridedShard(dim=0, sf=2)" in line
    assert tree_digest(sample.role_dir) == before


# --- the SFT trainer's step folder ------------------------------------------------------------------


def test_sft_step_folder_merges_with_role_model(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(SFT)
    assert sample.role_dir.name == "global_step_1" and (sample.role_dir / "data_0.pt").is_file()
    merge_ok(capsys, sample.role_dir, tmp_path / "out")

    assert_bit_exact(load_safetensors_dir(tmp_path / "out"), load_file(sample.reference_dir / "model.safetensors"))
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["source"]["role"] == "model"
    assert [i["path"] for i in manifest["source"]["inputs"]] == [
        str(sample.role_dir / f"model_world_size_2_rank_{r}.pt") for r in range(2)
    ]


def test_sft_partition_key_has_no_role_part():
    key = checkpoint_key("team/exp/global_step_7")
    assert (key.run, key.step, key.role) == ("team/exp", 7, "model")
    assert str(key) == "team/exp/global_step_7" and str(key.path) == "team/exp/global_step_7"
    assert checkpoint_key("team/exp/global_step_7/actor").role == "actor"


def test_sft_checkpoint_name_has_run_step_and_role():
    name = checkpoint_name(Path("/ckpts/sft_run/global_step_7"))
    assert (name.run, name.step_folder, name.step, name.role, name.writer) == (
        "sft_run",
        "global_step_7",
        7,
        "model",
        "verl",
    )
    assert str(name) == str(checkpoint_key("sft_run/global_step_7"))


# --- NeMo-Automodel: consolidated HF safetensors in <role>/model/ ------------------------------------


@pytest.fixture
def nemo_checkpoint(tmp_path):
    role_dir = tmp_path / "checkpoints" / "global_step_1" / "actor"
    write_nemo_automodel_checkpoint(role_dir, FsdpSpec(), reference_dir=tmp_path / "reference", max_shard_size="300KB")
    return role_dir, tmp_path / "reference"


def test_nemo_automodel_model_folder_is_validated_and_copied(capsys, tmp_path, nemo_checkpoint):
    role_dir, reference_dir = nemo_checkpoint
    assert len(list((role_dir / "model").glob("model-*.safetensors"))) > 1
    out = tmp_path / "out"
    merge_ok(capsys, role_dir, out)

    assert_bit_exact(load_safetensors_dir(out), load_file(reference_dir / "model.safetensors"))
    assert json.loads((out / MANIFEST).read_text())["source"]["backend"] == "hf"
    for name in ("tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (role_dir / "model" / name).read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(role_dir / "model").eval()
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)


def test_nemo_automodel_truncated_shard_is_one_line(capsys, tmp_path, nemo_checkpoint):
    role_dir, _ = nemo_checkpoint
    shard = sorted((role_dir / "model").glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])

    line = merge_error(capsys, role_dir, tmp_path / "out")
    assert str(shard) in line and "truncated" in line
