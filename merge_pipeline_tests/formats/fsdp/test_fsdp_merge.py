"""FSDP checkpoints written by real torch FSDP merge bit for bit into loadable HF folders."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from merge_pipeline.hf.manifest import MANIFEST, sha256_file
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import (
    assert_loads_every_stored_value,
    load_safetensors_dir,
    merge_ok,
    same_bits,
)

LAYOUTS = {
    "fsdp2-ws2": FsdpSpec(),
    "fsdp2-ws3-uneven-vocab": FsdpSpec(world_size=3, vocab_size=1003),
    "fsdp2-ws4-empty-chunks": FsdpSpec(
        world_size=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, arch="llama"
    ),
    "fsdp1-ws2": FsdpSpec(fsdp_version=1),
    "fsdp1-ws1-plain-tensors": FsdpSpec(fsdp_version=1, world_size=1),
    "fsdp2-ws1": FsdpSpec(world_size=1, legacy_no_fsdp_config=True),
    "fsdp2-hsdp-2x2": FsdpSpec(world_size=4, mesh=(2, 2)),
    "bf16-llama": FsdpSpec(dtype=torch.bfloat16, arch="llama"),
}


def reference_model(sample, cls=transformers.AutoModelForCausalLM):
    config = transformers.AutoConfig.from_pretrained(sample.reference_dir)
    model = cls.from_config(config)
    model.load_state_dict(load_file(sample.reference_dir / "model.safetensors"), strict=False)
    return model.eval()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_merge_is_bit_exact(capsys, tmp_path, fsdp_checkpoint, layout):
    sample = fsdp_checkpoint(LAYOUTS[layout])
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "fsdp")
    merged = load_safetensors_dir(tmp_path / "out")
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == str(sample.spec.dtype).removeprefix("torch.")
    assert_loads_every_stored_value(tmp_path / "out")


def test_loads_with_transformers_and_matches_logits(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LAYOUTS["fsdp2-ws3-uneven-vocab"])
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "fsdp")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.tensor([[1, 5, 17, 1002, 40]])
    with torch.no_grad():
        assert torch.equal(merged(tokens).logits, reference_model(sample)(tokens).logits)
    source = sample.role_dir / "huggingface"
    copied = [p.name for p in source.iterdir() if p.name != "config.json"]
    assert "tokenizer.json" in copied and "generation_config.json" in copied
    for name in copied:
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.get_vocab() == transformers.AutoTokenizer.from_pretrained(source).get_vocab()


def test_bf16_output_and_sharding(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LAYOUTS["fsdp2-ws2"])
    merge_ok(
        capsys,
        sample.role_dir,
        tmp_path / "out",
        "--backend",
        "fsdp",
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "100KB",
    )
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert all(p.stat().st_size <= 100_000 + 4096 for p in out.glob("model-*.safetensors") if len(load_file(p)) > 1)
    merged = load_safetensors_dir(out)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in merged.values())
    for name, tensor in load_file(sample.reference_dir / "model.safetensors").items():
        assert same_bits(merged[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16


def test_tied_embeddings_drop_lm_head(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(FsdpSpec(tie_word_embeddings=True))
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "fsdp")
    merged = load_safetensors_dir(tmp_path / "out")
    assert "lm_head.weight" not in merged
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert same_bits(model.lm_head.weight.detach(), reference["model.embed_tokens.weight"])


def test_critic_becomes_token_classification(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(FsdpSpec(critic=True))
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "fsdp")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and config["num_labels"] == 1
    model = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "out").eval()
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert same_bits(model.score.weight.detach(), reference["score.weight"])
    tokens = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(
            model(tokens).logits, reference_model(sample, transformers.AutoModelForTokenClassification)(tokens).logits
        )


def test_lora_adapter_loads_with_peft(capsys, tmp_path, fsdp_checkpoint):
    import peft

    sample = fsdp_checkpoint(FsdpSpec(lora=(4, 8)))
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "fsdp")
    adapter_config = json.loads((tmp_path / "out" / "lora_adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8)
    assert sorted(adapter_config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "out" / "lora_adapter").eval()
    reference = load_file(sample.reference_dir / "model.safetensors")
    loaded = dict(with_adapter.named_parameters())
    for name, tensor in reference.items():
        assert same_bits(loaded[name].detach(), tensor), name


def test_merge_lora_equals_peft_merge(capsys, tmp_path, fsdp_checkpoint):
    import peft

    sample = fsdp_checkpoint(FsdpSpec(lora=(4, 8)))
    merge_ok(capsys, sample.role_dir, tmp_path / "merged", "--backend", "fsdp", "--merge-lora")
    assert not (tmp_path / "merged" / "lora_adapter").exists()
    merge_ok(capsys, sample.role_dir, tmp_path / "unmerged", "--backend", "fsdp")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "unmerged")
    expected = (
        peft.PeftModel.from_pretrained(base, tmp_path / "unmerged" / "lora_adapter").merge_and_unload().state_dict()
    )
    merged = load_safetensors_dir(tmp_path / "merged")
    assert set(merged) == set(expected)
    for name, tensor in merged.items():
        assert same_bits(tensor, expected[name]), name


def test_manifest_records_inputs_decisions_and_sums(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LAYOUTS["fsdp2-ws2"])
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "fsdp", "--dtype", "bfloat16")
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["source"]["layout"]["world_size"] == 2 and manifest["source"]["backend"] == "fsdp"
    assert [i["path"] for i in manifest["source"]["inputs"]] == [
        str(sample.role_dir / f"model_world_size_2_rank_{r}.pt") for r in range(2)
    ]
    assert manifest["decisions"]["tensor_dtypes"] == {
        "float32 -> bfloat16": len(load_safetensors_dir(tmp_path / "out"))
    }
    files = {p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file()} - {
        MANIFEST
    }
    assert set(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256_file(tmp_path / "out" / name)


def test_verify_replicas_on_hsdp_mesh(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LAYOUTS["fsdp2-hsdp-2x2"])
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "fsdp", "--verify-replicas")
    assert (tmp_path / "out" / "model.safetensors").is_file()
