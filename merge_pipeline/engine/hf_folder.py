"""Assemble the non-weight files of an HF folder: index, config, tokenizer and friends, LoRA adapter config."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from merge_pipeline.engine.outputs import OUTPUT_ADAPTER_DIR, OutputPlan
from merge_pipeline.errors import printable, shown_path
from merge_pipeline.files.inputs import read_capped
from merge_pipeline.hf.config import CONFIG, ModelConfig, output_config
from merge_pipeline.hf.file_names import INDEX, WEIGHT_SUFFIXES
from merge_pipeline.options import DEFAULT_MAX_SIDE_FILE_SIZE
from merge_pipeline.settings import parse_size

log = logging.getLogger(__name__)

# Weights in huggingface/ (hf.file_names.WEIGHT_SUFFIXES) are never copied: the merged weights replace them.
_WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")
# Data a model class reads beside its weights, not weights: Qwen2.5-Omni's speakers (its from_pretrained refuses a
# folder without them; transformers loads them with weights_only=True).
_MODEL_DATA_FILES = ("spk_dict.pt",)
# Training state a trainer saves beside config.json (DeepSpeed's tag file and converter scripts, the
# HF Trainer's state, NeMo-Automodel's shard plan): not part of a model folder, and zero_to_fp32.py is no
# model's remote code.
_TRAINING_STATE_FILES = (
    "latest",
    "zero_to_fp32.py",
    "zero_to_torch.py",
    "trainer_state.json",
    "fqn_to_file_index_mapping.json",
)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def copy_side_files(
    hf_dir: Path, out_dir: Path, max_file_size: str | int = DEFAULT_MAX_SIDE_FILE_SIZE, *, confine_to: Path | None
) -> list[str]:
    """Copy tokenizer / processor / chat template / generation config / remote code, as they are.

    Done first, so a trainer deleting the checkpoint mid-merge cannot take them away half-way.
    Only regular files whose real path lies inside ``confine_to`` (the checkpoint's role folder) are
    copied: any other one is refused with one line, because the merged folder may be published (a
    symlink to /proc/self/environ would put the environment, tokens included, on the Hub).
    """
    limit = parse_size(max_file_size, "--max-side-file-size")
    copied = []
    for src in sorted(hf_dir.iterdir()):
        if (
            src.name in (CONFIG, *_TRAINING_STATE_FILES)
            or (src.name.endswith(WEIGHT_SUFFIXES + _WEIGHT_INDEXES) and src.name not in _MODEL_DATA_FILES)
            or src.is_dir()
        ):
            continue
        _copy_capped(src, out_dir / src.name, limit, confine_to)
        copied.append(src.name)
    if not any(name in copied for name in _TOKENIZER_FILES):
        log.warning(
            "%s: no tokenizer files; the merged folder will have none (none is invented)", printable(shown_path(hf_dir))
        )
    return copied


def _copy_capped(src: Path, dst: Path, limit: int, confine_to: Path | None) -> None:
    """Copy a regular file of at most ``limit`` bytes, opened once (from inside ``confine_to`` when given)."""
    too_large = f"is larger than the side-file limit of {limit:,} bytes: pass --max-side-file-size to raise it"
    dst.write_bytes(read_capped(src, limit, too_large, inside=confine_to))


def write_index(outputs: OutputPlan, out_dir: Path) -> None:
    if not outputs.sharded:
        return
    weight_map = {t.planned.name: shard.filename for shard in outputs.shards for t in shard.tensors}
    index = {"metadata": {"total_size": sum(s.nbytes for s in outputs.shards)}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_configs(model: ModelConfig, outputs: OutputPlan, out_dir: Path) -> None:
    if not outputs.adapter_only:  # an adapter folder has no model config: PEFT reads adapter_config.json
        config = output_config(model, dtype=outputs.config_dtype, tied=outputs.tied, value_model=outputs.is_value_model)
        if outputs.fp8 is not None:
            config["quantization_config"] = outputs.fp8.quantization_config
        if outputs.quantization is not None:
            config["quantization_config"] = outputs.quantization.quantization_config
        if outputs.fp8 is None and outputs.quantization is None:
            _drop_unwritten_quantization(config, outputs)
        write_json(out_dir / CONFIG, config)
    if outputs.adapter is None:
        return
    from peft import LoraConfig  # imported only for LoRA runs: peft pulls in much of transformers (~1.5 s)

    adapter_dir = out_dir if outputs.adapter_only else out_dir / OUTPUT_ADAPTER_DIR
    adapter_dir.mkdir(exist_ok=True)
    lora = LoraConfig(
        r=outputs.lora.r,
        lora_alpha=outputs.lora.lora_alpha,
        target_modules=outputs.lora_targets,
        task_type=outputs.lora.task_type,
        # With base weights, they sit in the parent folder; an adapter alone names no base (the
        # checkpoint does not record where the base model was): the user passes it to PEFT.
        base_model_name_or_path=None if outputs.adapter_only else "..",
        inference_mode=True,
    )
    lora.save_pretrained(str(adapter_dir))


def _drop_unwritten_quantization(config: dict, outputs: OutputPlan) -> None:
    """The source config's ``quantization_config``, left out when the merged weights are plain (e.g. a gpt-oss
    fine-tune trained from its dequantized MXFP4 base: loaders would read plain weights as the base's quantized
    ones); kept for an HF folder of quantized weights merged as it is."""
    if "quantization_config" not in config or _writes_quantized_weights(outputs):
        return
    source = config["quantization_config"]
    method = source.get("quant_method") if isinstance(source, dict) else None
    log.warning(
        "config.json: the source's quantization_config (%s) left out: the merged weights are not quantized",
        printable(str(method or "no quant_method")),
    )
    del config["quantization_config"]


_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int32)


def _writes_quantized_weights(outputs: OutputPlan) -> bool:
    """Whether a written tensor is a quantized format's (FP8, packed integers: an HF folder merged as it is)."""
    return any(t.dtype in _QUANTIZED_DTYPES for shard in outputs.shards for t in shard.tensors)
