"""``--quantize as-base``: the base model's own quantization_config (``--hf_model_path``'s config.json) written as
it states: a compressed-tensors group byte for byte what llm-compressor's ``model_free_ptq`` writes given that
config, FP8 blocks as ``--dtype fp8`` writes them, gpt-oss's MXFP4 experts as transformers reads them back; or
one line saying why not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from merge_pipeline.cli import main
from merge_pipeline.hub.model_card import render_card
from merge_pipeline_tests.engine.test_fp8 import LLAMA, TOKENS
from merge_pipeline_tests.helpers import (
    assert_torchrun_writes_what_one_process_writes,
    load_safetensors_dir,
    merge_error,
    merge_ok,
    same_bits,
    write_with_release,
)

W4A16_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group",
                "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}},
    "input_activations": None,
    "output_activations": None,
}  # fmt: skip
IGNORE = ["lm_head", "model.embed_tokens", "re:.*self_attn.*"]
COMPRESSED = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": IGNORE}
GROUP_32 = {**W4A16_GROUP, "weights": {**W4A16_GROUP["weights"], "group_size": 32}}  # Kimi-K2's group
ASYMMETRIC = {**W4A16_GROUP, "weights": {**W4A16_GROUP["weights"], "symmetric": False, "zp_dtype": "torch.int8"}}
BASES = {
    "w4a16": {**COMPRESSED, "config_groups": {"group_0": W4A16_GROUP}},
    "w4a16_asym": {**COMPRESSED, "config_groups": {"group_0": ASYMMETRIC}},
    "kimi_k2": {**COMPRESSED, "config_groups": {"group_0": GROUP_32}, "kv_cache_scheme": None,
                "quantization_status": "compressed"},
}  # fmt: skip
MXFP4_KEPT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def llama(fsdp_checkpoint):
    return fsdp_checkpoint(LLAMA).role_dir


@pytest.fixture(scope="module")
def references(tmp_path_factory, llama):
    """name -> llm-compressor's ``model_free_ptq`` folder of the bf16 merge, given the base's config ``BASES[name]``."""
    root = tmp_path_factory.mktemp("as_base")
    assert main(["merge", "--local_dir", str(llama), "--target_dir", str(root / "bf16"), "--dtype", "bfloat16"]) == 0
    for name, config in BASES.items():
        (root / f"{name}.json").write_text(json.dumps(config))
    configs = [str(root / f"{name}.json") for name in BASES]
    write_with_release(
        ".venv-llmcompressor", "model_free_ptq.py", root / "reference", str(root / "bf16"), "[]", *configs
    )
    return {name: root / "reference" / name for name in BASES}


def _base(folder: Path, role_dir: Path, quantization_config: dict | None) -> Path:
    """The base model's folder: the checkpoint's config.json with ``quantization_config``."""
    config = json.loads((role_dir / "huggingface" / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _same_weights(ours: Path, theirs: Path) -> None:
    mine, reference = load_safetensors_dir(ours), load_safetensors_dir(theirs)
    assert sorted(mine) == sorted(reference)
    assert all(same_bits(mine[name], tensor) for name, tensor in reference.items())


@pytest.mark.parametrize("name", BASES)
def test_a_compressed_tensors_base_is_written_as_llm_compressor_writes_it(capsys, tmp_path, llama, references, name):
    base = _base(tmp_path / "base", llama, BASES[name])
    out = merge_ok(capsys, llama, tmp_path / "as_base", "--quantize", "as-base", "--hf_model_path", base)
    assert "; group_0: 6 weights quantized (pack-quantized)" in out  # the MLPs: attention is ignored as the base says
    _same_weights(tmp_path / "as_base", references[name])
    config = json.loads((tmp_path / "as_base" / "config.json").read_text())["quantization_config"]
    reference = json.loads((references[name] / "config.json").read_text())["quantization_config"]
    assert config.pop("version") == reference.pop("version")
    assert config == reference and config["ignore"] == IGNORE
    if name in ("w4a16", "w4a16_asym"):  # the preset's own bytes
        merge_ok(capsys, llama, tmp_path / "named", "--quantize", name.upper(), "--quantize-ignore", *IGNORE)
        _same_weights(tmp_path / "as_base", tmp_path / "named")
    if name == "w4a16_asym":
        return  # transformers 5.25 does not read packed zero points (test_quantize.py reads them back)
    transformers.logging.set_verbosity_error()
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "as_base", output_loading_info=True)
    assert not any(info.values()), info


def test_an_fp8_block_base_is_written_as_dtype_fp8_with_its_block(capsys, tmp_path, llama):
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}
    base = _base(tmp_path / "base", llama, fp8)
    merge_ok(capsys, llama, tmp_path / "named", "--dtype", "fp8", "--fp8-block-size", "64")
    out = merge_ok(capsys, llama, tmp_path / "as_base", "--quantize", "as-base", "--hf_model_path", base)
    assert "fp8: 14 weights quantized in 64x64 blocks" in out
    _same_weights(tmp_path / "as_base", tmp_path / "named")
    written = json.loads((tmp_path / "as_base" / "config.json").read_text())["quantization_config"]
    assert written["weight_block_size"] == [64, 64]


@pytest.mark.parametrize(
    "quantization_config, problem",
    [
        (None, "the base model has no quantization_config, nothing to follow; name a scheme instead (W4A16, "),
        ({"quant_method": "awq", "bits": 4}, "the base's quant_method 'awq' is not written by this tool"),
        (
            {**COMPRESSED, "config_groups": {"group_0": {**W4A16_GROUP, "weights": {**W4A16_GROUP["weights"], "num_bits": 2}}}},
            "the base's config group 'group_0' is written by no preset we write byte for byte; nearest W4A16, which"
            " differs in weights.num_bits 2 (4)",
        ),
        (
            {**COMPRESSED, "config_groups": {"a": W4A16_GROUP, "b": GROUP_32}},
            "the base has 2 config groups; one is written",
        ),
        (
            {**COMPRESSED, "format": "int-quantized", "config_groups": {"group_0": W4A16_GROUP}},
            "nearest W4A16, which differs in format 'int-quantized' ('pack-quantized')",
        ),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
            "the base's fp8 activation_scheme 'static' needs scales calibrated on data",
        ),
    ],
)  # fmt: skip
def test_a_base_format_we_cannot_write_is_refused_in_one_line(capsys, tmp_path, llama, quantization_config, problem):
    base = _base(tmp_path / "base", llama, quantization_config)
    line = merge_error(capsys, llama, tmp_path / "out", "--quantize", "as-base", "--hf_model_path", base)
    assert line.startswith(f"error: {base / 'config.json'}: --quantize as-base: "), line
    assert problem in line, line


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss (transformers' own writer, bf16) as a step folder read with ``--backend hf``, and its
    base: the same config.json with gpt-oss's MXFP4 quantization_config."""
    root = tmp_path_factory.mktemp("gpt_oss")
    torch.manual_seed(0)
    config = transformers.GptOssConfig(
        vocab_size=1003, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    role_dir = root / "global_step_1" / "actor"
    transformers.GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(role_dir / "model")
    base = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_KEPT}
    config.quantization_config = base
    config.save_pretrained(root / "base")
    return role_dir, root / "base"


@pytest.mark.slow  # its checkpoint is written by transformers' save_pretrained, which the tiers cannot see
def test_a_gpt_oss_mxfp4_base_round_trips_through_transformers_dequantizer(capsys, tmp_path, gpt_oss):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    role_dir, base = gpt_oss
    merge_ok(capsys, role_dir, tmp_path / "bf16", "--backend", "hf", "--dtype", "bfloat16")
    flags = ("--backend", "hf", "--quantize", "as-base", "--hf_model_path", base)
    out = merge_ok(capsys, role_dir, tmp_path / "mxfp4", *flags)
    assert "; MXFP4: 4 weights quantized (experts' blocks and scales), 4 modules kept in bfloat16" in out
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_KEPT}
    ours, merged = load_safetensors_dir(tmp_path / "mxfp4"), load_safetensors_dir(tmp_path / "bf16")
    experts = {n for n in merged if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(experts) == 4
    assert sorted(ours) == sorted({*merged} - experts | {f"{n}_{s}" for n in experts for s in ("blocks", "scales")})
    for name in experts:
        blocks, scales = ours[f"{name}_blocks"], ours[f"{name}_scales"]
        assert blocks.dtype == scales.dtype == torch.uint8
        weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert weight.shape == merged[name].shape
        # MXFP4's rounding error: at most half E2M1's widest step (4 to 6) times the group's power of two
        half_step = torch.pow(2.0, scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)
        error = (weight - merged[name].float()).abs()
        assert (error <= half_step).all() and error.mean() < merged[name].float().abs().mean() / 8, name
    assert all(same_bits(ours[n], t) for n, t in merged.items() if n not in experts)
    transformers.logging.set_verbosity_error()
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mxfp4", output_loading_info=True)
    assert not any(info.values()), info
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    with torch.no_grad():
        ours, theirs = loaded.eval()(TOKENS).logits.float(), reference.eval()(TOKENS).logits.float()
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    card = render_card(json.loads((tmp_path / "mxfp4" / "merge_manifest.json").read_text()), "org/model")
    assert "| weights | 4 linear weights in MXFP4 (quant_method mxfp4: experts' blocks and scales) |" in card


@pytest.mark.torchrun
def test_torchrun_ranks_write_the_mxfp4_base_byte_identically(capsys, tmp_path, gpt_oss):
    """Each rank writes its own shards of gpt-oss's MXFP4 experts (blocks and scales beside the kept weights):
    the same folder, byte for byte, as one process writes."""
    role_dir, base = gpt_oss
    flags = ("--backend", "hf", "--quantize", "as-base", "--hf_model_path", base, "--max-shard-size", "100KB")
    assert_torchrun_writes_what_one_process_writes(capsys, role_dir, tmp_path, *flags)
