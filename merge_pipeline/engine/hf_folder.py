"""Assemble the non-weight files of an HF folder: config, tokenizer and friends, LoRA adapter config."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from merge_pipeline.engine.hf_config import CONFIG, ModelConfig, output_config
from merge_pipeline.engine.outputs import ADAPTER_DIR, OutputLayout

log = logging.getLogger(__name__)

# Weights in huggingface/ are never copied: the merged weights replace them.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = (".safetensors.index.json", ".bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def copy_side_files(hf_dir: Path, out_dir: Path) -> list[str]:
    """Copy tokenizer / processor / chat template / generation config / remote code, as they are.

    Done first, so a trainer deleting the checkpoint mid-merge cannot take them away half-way.
    """
    copied = []
    for src in sorted(hf_dir.iterdir()):
        if not src.is_file() or src.name == CONFIG or src.name.endswith(_WEIGHT_SUFFIXES + _WEIGHT_INDEXES):
            continue
        shutil.copy2(src, out_dir / src.name)
        copied.append(src.name)
    if not any(name in copied for name in _TOKENIZER_FILES):
        log.warning("%s: no tokenizer files; the merged folder will have none (none is invented)", hf_dir)
    return copied


def write_configs(model: ModelConfig, layout: OutputLayout, out_dir: Path) -> None:
    if not layout.adapter_only:  # an adapter folder has no model config: PEFT reads adapter_config.json
        config = output_config(model, dtype=layout.config_dtype, tied=layout.tied, value_model=layout.is_value_model)
        write_json(out_dir / CONFIG, config)
    if layout.adapter is None:
        return
    from peft import LoraConfig  # imported only for LoRA runs: peft pulls in much of transformers (~1.5 s)

    adapter_dir = out_dir if layout.adapter_only else out_dir / ADAPTER_DIR
    adapter_dir.mkdir(exist_ok=True)
    lora = LoraConfig(
        r=layout.lora.r,
        lora_alpha=layout.lora.lora_alpha,
        target_modules=layout.lora_targets,
        task_type=layout.lora.task_type,
        # With base weights, they sit in the parent folder; an adapter alone names no base (the
        # checkpoint does not record where the base model was): the user passes it to PEFT.
        base_model_name_or_path=None if layout.adapter_only else "..",
        inference_mode=True,
    )
    lora.save_pretrained(str(adapter_dir))
