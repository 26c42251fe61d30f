"""verl 0.9's Megatron layout schema v2 (``ckpt_contents.json``, ``model/dist_ckpt``, ``model/huggingface``),
merged from the CLI and found by the sensor, pointed at the role folder as a verl user would."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import time
from pathlib import Path

import dagster as dg
import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import MetadataIndex

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.watch.discovery import completeness
from merge_pipeline_samples.megatron import (
    LORA_ALPHA,
    LORA_R,
    LORA_TARGETS,
    arrange_v2,
    sample_tokens,
    write_bridge_weights,
)
from merge_pipeline_tests.dagster.helpers import LOCATION, materialize
from merge_pipeline_tests.helpers import (
    assert_bit_exact,
    load_safetensors_dir,
    merge_error,
    merge_ok,
    run_cli,
    same_bits,
    tree_digest,
)

new_checkpoint_sensor = LOCATION.resolve_sensor_def("new_checkpoint_sensor")


def logits(folder, model_class=transformers.AutoModelForCausalLM) -> torch.Tensor:
    model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(sample_tokens()[None]).logits[0]


@pytest.fixture
def v2(megatron_samples, tmp_path):
    """``v2(name, mode, role="actor")``: a v1 sample copied into the v2 tree verl writes in ``mode``."""

    def arrange(name: str, mode: str, role: str = "actor"):
        return arrange_v2(megatron_samples[name], tmp_path / f"{name}_{mode}" / "global_step_1" / role, mode)

    return arrange


# ---- item 1: where the weights are -------------------------------------------------------------


def test_real_v2_dist_checkpoint_needs_and_uses_hf_model_path(megatron_v2_sample, tmp_path, capsys):
    """megatron-core shards in model/dist_ckpt and no HF file in the checkpoint (verl's
    use_dist_checkpointing without hf_model): the config and tokenizer come from --hf_model_path."""
    sample = megatron_v2_sample
    role = sample.role_dir
    assert json.loads((role / "ckpt_contents.json").read_text())["contents"]["model"]["path"] == "model/dist_ckpt"
    assert not (role / "model" / "huggingface").exists() and not any((role / "optimizer" / "dist_ckpt").iterdir())
    before = tree_digest(role)

    line = merge_error(capsys, role, tmp_path / "out")
    assert "--hf_model_path" in line and "config.json" in line

    merge_ok(capsys, role, tmp_path / "out", "--hf_model_path", sample.original_dir)
    assert_bit_exact(tmp_path / "out", sample.reference_dir)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (sample.original_dir / "tokenizer.json").read_bytes()
    torch.testing.assert_close(
        logits(tmp_path / "out"), torch.load(sample.logits_path, weights_only=True), atol=2e-5, rtol=2e-5
    )
    code, out, err = run_cli(capsys, "inspect", role, "--json", "--hf_model_path", sample.original_dir)
    assert code == 0, err
    info = json.loads(out)
    assert (info["layout_schema"], info["tp"], info["architecture"]) == ("v2", 2, "Qwen2ForCausalLM")
    assert tree_digest(role) == before


def test_bridge_default_single_file_without_metadata(v2, tmp_path, capsys):
    """verl's default (bridge): one model.safetensors, no index, no header metadata, mode 600, and an
    empty model/dist_ckpt/ beside it."""
    sample = v2("qwen2_tp2", "bridge")
    hf_dir = sample.role_dir / "model" / "huggingface"
    weights = hf_dir / "model.safetensors"
    assert sorted(p.name for p in hf_dir.glob("*.safetensors*")) == ["model.safetensors"]
    assert weights.stat().st_mode & 0o777 == 0o600
    (header_length,) = struct.unpack("<Q", weights.read_bytes()[:8])
    assert "__metadata__" not in json.loads(weights.read_bytes()[8 : 8 + header_length])
    assert not any((sample.role_dir / "model" / "dist_ckpt").iterdir())

    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "megatron")
    assert_bit_exact(tmp_path / "out", sample.reference_dir)
    assert torch.equal(logits(tmp_path / "out"), logits(sample.reference_dir))
    assert weights.stat().st_mode & 0o777 == 0o600  # input untouched


def test_hybrid_reads_the_shards_the_manifest_names(v2, tmp_path, capsys):
    sample = v2("qwen2_tp2", "hybrid")
    merge_ok(capsys, sample.role_dir, tmp_path / "out")
    assert_bit_exact(tmp_path / "out", sample.reference_dir)
    layout = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())["source"]["layout"]
    assert (layout["layout_schema"], layout["model_weights"], layout["tp"]) == (
        "v2",
        str(sample.role_dir / "model" / "dist_ckpt"),
        2,
    )


@pytest.mark.parametrize("mode", ["dist", "bridge"])
def test_without_manifest_probes_dist_ckpt_then_huggingface(v2, tmp_path, capsys, mode):
    sample = v2("qwen2_tp2", mode)
    (sample.role_dir / "ckpt_contents.json").unlink()
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--hf-model-path", sample.original_dir)
    assert_bit_exact(tmp_path / "out", sample.reference_dir)


def test_empty_legacy_dist_ckpt_is_not_a_broken_checkpoint(fresh_megatron, tmp_path, capsys):
    sample = fresh_megatron("qwen2_hf_weights")
    shutil.rmtree(sample.role_dir / "dist_ckpt")
    (sample.role_dir / "dist_ckpt").mkdir()
    merge_ok(capsys, sample.role_dir, tmp_path / "out")
    assert_bit_exact(tmp_path / "out", sample.reference_dir)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda m: m.update(schema_version=3), "schema_version 3"),
        (lambda m: m["contents"]["model"].update(path="../../elsewhere"), "is not a folder inside the checkpoint"),
        (lambda m: m["contents"]["model"].update(format="gguf"), "contents.model.format 'gguf'"),
        (lambda m: m["contents"].pop("model"), "saved no model weights"),
    ],
    ids=["schema", "path", "format", "no-model"],
)
def test_a_manifest_we_cannot_follow_is_one_line(v2, tmp_path, capsys, change, problem):
    sample = v2("qwen2_tp2", "bridge")
    manifest = sample.role_dir / "ckpt_contents.json"
    data = json.loads(manifest.read_text())
    change(data)
    manifest.write_text(json.dumps(data))
    before = tree_digest(sample.role_dir)
    line = merge_error(capsys, sample.role_dir, tmp_path / "out")
    assert line.startswith(f"error: {manifest}: ") and problem in line
    assert tree_digest(sample.role_dir) == before


def test_manifest_naming_an_empty_dist_ckpt(v2, tmp_path, capsys):
    sample = v2("qwen2_tp2", "dist")
    shutil.rmtree(sample.role_dir / "model" / "dist_ckpt")
    (sample.role_dir / "model" / "dist_ckpt").mkdir()
    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", sample.original_dir)
    assert "model/dist_ckpt" in line and "holds no model tensors" in line


def test_critic_role_folder_is_a_value_model(v2, tmp_path, capsys):
    critic = v2("qwen2_value", "dist", role="critic")
    merge_ok(capsys, critic.role_dir, tmp_path / "critic", "--hf_model_path", critic.original_dir)
    model = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert model.config.num_labels == 1
    assert same_bits(model.score.weight.detach(), load_file(critic.reference_dir / "model.safetensors")["score.weight"])
    # verl's critic always has a one-row value head: a full LM head under critic/ is not one
    lm = v2("qwen2_tp2", "dist", role="critic")
    line = merge_error(capsys, lm.role_dir, tmp_path / "lm", "--hf_model_path", lm.original_dir)
    assert "value model requested but output_layer.weight has 128 rows" in line


# ---- item 2: --hf_model_path when both exist ---------------------------------------------------


def test_hf_model_path_must_describe_the_same_model(v2, tmp_path, capsys):
    sample = v2("qwen2_tp2", "hybrid")
    original = tmp_path / "original"
    shutil.copytree(sample.original_dir, original)
    config = json.loads((original / "config.json").read_text())
    (original / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": 8, "architectures": ["LlamaForCausalLM"]})
    )
    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", original)
    assert (
        line.startswith(f"error: {original / 'config.json'}: ")
        and "num_hidden_layers 4 vs 8" in line
        and "architectures" in line
    )

    (original / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))  # not a size: fine
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", original)
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    )  # the checkpoint's own config won


def test_hf_model_path_without_config_is_named(v2, tmp_path, capsys):
    sample = v2("qwen2_tp2", "dist")
    empty = tmp_path / "base"  # beside the target: a target inside an input (--hf_model_path too) is refused first
    empty.mkdir()
    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", empty)
    assert line.startswith(f"error: {empty / 'config.json'}: not found: --hf_model_path")


# ---- item 3: LoRA with the bridge --------------------------------------------------------------


def test_bridge_lora_adapter_base_from_hf_model_path(v2, tmp_path, capsys):
    import peft

    sample = v2("qwen2_tp2", "bridge_peft")
    adapter_dir = sample.role_dir / "model" / "huggingface" / "adapter"
    line = merge_error(capsys, sample.role_dir, tmp_path / "out")
    assert "LoRA adapter" in line and "--hf_model_path" in line

    original = tmp_path / "original"  # the trainer's model.path: config, tokenizer and the base weights
    shutil.copytree(sample.original_dir, original)
    shutil.copy(sample.reference_dir / "model.safetensors", original)
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", original)
    assert_bit_exact(tmp_path / "out", sample.reference_dir)
    adapter_config = json.loads((tmp_path / "out" / "lora_adapter" / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], sorted(adapter_config["target_modules"])) == (
        LORA_R,
        LORA_ALPHA,
        LORA_TARGETS,
    )
    trained = load_file(adapter_dir / "adapter_model.safetensors")
    written = load_file(tmp_path / "out" / "lora_adapter" / "adapter_model.safetensors")
    assert set(written) == set(trained) and all(same_bits(written[k], trained[k]) for k in trained)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "out" / "lora_adapter")
    expected = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(sample.reference_dir), adapter_dir
    )
    assert torch.equal(loaded(sample_tokens()[None]).logits, expected(sample_tokens()[None]).logits)

    merge_ok(capsys, sample.role_dir, tmp_path / "merged", "--hf_model_path", original, "--merge-lora")
    assert not (tmp_path / "merged" / "lora_adapter").exists()
    reference_merge = expected.merge_and_unload().state_dict()
    merged = load_safetensors_dir(tmp_path / "merged")
    assert set(merged) == set(reference_merge)
    assert all(same_bits(merged[k], reference_merge[k]) for k in merged)
    assert not same_bits(
        merged["model.layers.0.self_attn.q_proj.weight"],
        load_file(sample.reference_dir / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"],
    )


def test_bridge_lora_adapter_beside_base_weights(v2, tmp_path, capsys):
    sample = v2("qwen2_tp2", "bridge_peft")
    write_bridge_weights(sample.reference_dir, sample.role_dir / "model" / "huggingface")
    merge_ok(capsys, sample.role_dir, tmp_path / "out")
    assert_bit_exact(tmp_path / "out", sample.reference_dir)
    assert (tmp_path / "out" / "lora_adapter" / "adapter_model.safetensors").is_file()


def test_adapter_only_as_megatron_shards_is_refused(v2, fresh_megatron, tmp_path, capsys):
    sample = v2("qwen2_tp2", "bridge_peft")
    shutil.rmtree(sample.role_dir / "model" / "huggingface" / "adapter")
    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", sample.original_dir)
    assert line.startswith(f"error: {sample.role_dir / 'model' / 'dist_ckpt'}: ") and "lora_alpha" in line

    legacy = fresh_megatron("qwen2_hf_weights")
    (legacy.role_dir / "adapter_checkpoint").mkdir()
    line = merge_error(capsys, legacy.role_dir, tmp_path / "legacy")
    assert (
        line.startswith(f"error: {legacy.role_dir / 'adapter_checkpoint'}: ") and "cannot be converted exactly" in line
    )


@pytest.mark.parametrize(
    ("change", "culprit", "problem"),
    [
        ({"use_dora": True}, "adapter_config.json", "use_dora=True is not supported"),
        ({"r": 8}, "adapter_model.safetensors", "shape (4, 64), expected (8, 64) for r=8"),
    ],
    ids=["dora", "rank"],
)
def test_an_adapter_we_cannot_merge_exactly_is_named(v2, tmp_path, capsys, change, culprit, problem):
    sample = v2("qwen2_tp2", "bridge_peft")
    adapter_dir = sample.role_dir / "model" / "huggingface" / "adapter"
    config_path = adapter_dir / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **change}))
    line = merge_error(capsys, sample.role_dir, tmp_path / "out", "--hf_model_path", sample.reference_dir)
    assert line.startswith(f"error: {adapter_dir / culprit}: ") and problem in line


# ---- item 4: Megatron-FSDP ---------------------------------------------------------------------


def test_megatron_fsdp_uneven_dtensor_shards_merge_bit_exact(megatron_fsdp_sample, tmp_path, capsys):
    """Megatron-FSDP's own save (megatron-core 0.18.2, 3 gloo ranks): its flat-buffer sharding splits
    each tensor at whatever row its buffer shard ends, a rank may hold none of it, and every key sits
    behind the FSDP wrapper's ``module.``. Merged from the CLI, every tensor equals the Qwen3 it loaded
    (and so do transformers' logits)."""
    sample = megatron_fsdp_sample
    dist_dir = sample.role_dir / "model" / "dist_ckpt"
    metadata = dcp.FileSystemReader(str(dist_dir)).read_metadata().state_dict_metadata
    rows = {key: [c.sizes[0] for c in meta.chunks] for key, meta in metadata.items() if key.startswith("model.")}
    assert rows["model.module.decoder.layers.0.self_attention.linear_qkv.weight"] == [2, 126]
    assert rows["model.module.embedding.word_embeddings.weight"] == [171, 85]
    assert "model.module.decoder.layers.0.mlp.linear_fc1.weight_w" in rows  # megatron-core's SwiGLU split
    assert not (dist_dir / "metadata.json").exists()
    before = tree_digest(sample.role_dir)
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "auto", "--hf_model_path", sample.original_dir)
    assert_bit_exact(tmp_path / "out", sample.reference_dir)
    assert torch.equal(logits(tmp_path / "out"), logits(sample.reference_dir))
    layout = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())["source"]["layout"]
    assert (layout["sharded_backend"], layout["layer_keys"], layout["files"]) == (
        "megatron_fsdp (torch DCP of DTensors)",
        "per-layer",
        3,
    )
    assert tree_digest(sample.role_dir) == before


def test_megatron_fsdp_keys_without_a_megatron_name_name_the_layout(megatron_fsdp_sample, tmp_path, capsys):
    role_dir = tmp_path / "global_step_1" / "actor"
    shutil.copytree(megatron_fsdp_sample.role_dir, role_dir)
    metadata_path = role_dir / "model" / "dist_ckpt" / ".metadata"
    metadata = dcp.FileSystemReader(str(metadata_path.parent)).read_metadata()
    old, new = (
        "model.module.decoder.layers.0.mlp.linear_fc2.weight",
        "model.module.decoder.layers.0.self_attention.in_proj.weight",
    )  # a gated-delta-net name
    metadata.state_dict_metadata[new] = metadata.state_dict_metadata.pop(old)
    metadata.storage_data = {
        (MetadataIndex(new, i.offset, i.index) if i.fqn == old else i): info
        for i, info in metadata.storage_data.items()
    }
    metadata_path.write_bytes(pickle.dumps(metadata))
    line = merge_error(capsys, role_dir, tmp_path / "out", "--hf_model_path", megatron_fsdp_sample.original_dir)
    assert (
        line.startswith(f"error: {metadata_path}: Megatron-FSDP checkpoint (one DCP of DTensors): ")
        and "decoder.layers.0.self_attention.in_proj.weight" in line
    )


# ---- item 5: a zero-width shared expert --------------------------------------------------------


def test_qwen2_moe_without_shared_expert_loads_with_nothing_missing(megatron_samples, tmp_path, capsys):
    """megatron-core builds no shared expert when its size is 0; transformers builds one of width 0
    and a gate. Both are written (empty, zeros), so from_pretrained misses nothing, and the model
    computes what megatron-core computed."""
    sample = megatron_samples["qwen2_moe_no_shared_expert"]
    merge_ok(capsys, sample.role_dir, tmp_path / "out")
    merged = load_safetensors_dir(tmp_path / "out")
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert all(same_bits(merged[k], reference[k]) for k in reference)
    assert merged["model.layers.0.mlp.shared_expert.down_proj.weight"].shape == (64, 0)
    assert not merged["model.layers.0.mlp.shared_expert_gate.weight"].any()
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    torch.testing.assert_close(
        logits(tmp_path / "out"), torch.load(sample.logits_path, weights_only=True), atol=2e-5, rtol=2e-5
    )


# ---- item 6: the sensor ------------------------------------------------------------------------


def test_sensor_waits_for_the_manifest_then_the_assets_merge(v2, tmp_path):
    sample = v2("qwen2_tp2", "bridge")
    root = tmp_path / "checkpoints"
    role_dir = root / "run" / "global_step_3" / "actor"
    shutil.copytree(sample.role_dir, role_dir)
    manifest = role_dir / "ckpt_contents.json"
    kept = manifest.read_bytes()
    manifest.unlink()
    then = time.time() - 3600
    for path in [role_dir, *role_dir.rglob("*")]:
        os.utime(path, (then, then))

    state = completeness(role_dir, 3, settle_seconds=60)
    assert not state.complete and "ckpt_contents.json" in state.reason  # quiet for an hour, still not done
    settings = MergeSettings(checkpoint_roots=[str(root)], output_root=str(tmp_path / "merged"), settle_seconds=60)
    with dg.DagsterInstance.ephemeral() as instance:
        tick = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"settings": settings}))
        assert not tick.run_requests
        manifest.write_bytes(kept)
        tick = new_checkpoint_sensor(dg.build_sensor_context(instance=instance, resources={"settings": settings}))
        assert [r.partition_key for r in tick.run_requests] == ["run/global_step_3/actor"]
        result = materialize(instance, settings, "run/global_step_3/actor")
        assert result.success
    assert_bit_exact(Path(settings.output_root) / "run" / "global_step_3" / "actor", sample.reference_dir)
