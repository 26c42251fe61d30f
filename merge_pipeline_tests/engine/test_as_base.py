"""``--quantize as-base``: the base model's own quantization_config (``--hf_model_path``'s config.json) written
as the scheme it states: the same bytes as naming that scheme, or one line saying why not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from merge_pipeline_tests.engine.test_fp8 import LLAMA
from merge_pipeline_tests.helpers import load_safetensors_dir, merge_error, merge_ok, same_bits

W4A16_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group",
                "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}},
    "input_activations": None,
    "output_activations": None,
}  # fmt: skip
IGNORE = ["lm_head", "model.embed_tokens", "re:.*self_attn.*"]
COMPRESSED = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": IGNORE}


@pytest.fixture(scope="module")
def llama(fsdp_checkpoint):
    return fsdp_checkpoint(LLAMA).role_dir


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


def test_a_compressed_tensors_base_is_written_as_its_preset(capsys, tmp_path, llama):
    base = _base(tmp_path / "base", llama, {**COMPRESSED, "config_groups": {"group_0": W4A16_GROUP}})
    merge_ok(capsys, llama, tmp_path / "named", "--quantize", "W4A16", "--quantize-ignore", *IGNORE)
    out = merge_ok(capsys, llama, tmp_path / "as_base", "--quantize", "as-base", "--hf_model_path", base)
    assert "W4A16: 6 weights quantized (pack-quantized)" in out  # the MLPs: attention is ignored as the base says
    _same_weights(tmp_path / "as_base", tmp_path / "named")
    config = json.loads((tmp_path / "as_base" / "config.json").read_text())
    assert config == json.loads((tmp_path / "named" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == IGNORE
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
            {**COMPRESSED, "config_groups": {"group_0": {**W4A16_GROUP, "weights": {**W4A16_GROUP["weights"], "group_size": 32}}}},
            "the base's config is no preset written byte for byte; nearest W4A16, which differs in"
            " weights.group_size 32 (128)",
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
