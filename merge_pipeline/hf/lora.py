"""LoRA as PEFT names it, and the settings verl records beside a LoRA checkpoint.

A PEFT-wrapped model's state dict names its tensors
``base_model.model.<module>.base_layer.weight``, ``<module>.lora_A.<adapter>.weight`` and
``<module>.lora_B.<adapter>.weight``; everything else is ``base_model.model.<name>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.plan import LoraInfo, PlannedTensor

PEFT_PREFIX = "base_model.model."
LORA_META = "lora_train_meta.json"
ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter folder: this config and its weights
ADAPTER_FILE = "adapter_model.safetensors"
OUTPUT_ADAPTER_DIR = "lora_adapter"  # a merged folder's adapter: base weights beside it; PEFT loads it from here
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?:(?P<adapter>[^.]+)\.)?weight$")


def read_lora_meta(path: Path) -> LoraInfo:
    """verl's ``lora_train_meta.json``: ``r`` a positive integer, ``lora_alpha`` any finite number."""
    meta = read_json_object(path)
    r, alpha, task_type = meta.get("r"), meta.get("lora_alpha"), meta.get("task_type", "CAUSAL_LM")
    if type(r) is not int or r <= 0:  # type(): a JSON true is a bool, and bool is an int subclass
        raise MergeError(path, f"'r' must be a positive integer, found {r!r:.40}")
    if type(alpha) not in (int, float) or not math.isfinite(alpha):
        raise MergeError(path, f"'lora_alpha' must be a finite number, found {alpha!r:.40}")
    if not isinstance(task_type, str):
        raise MergeError(path, f"'task_type' must be a string, found {task_type!r:.40}")
    return LoraInfo(r=r, lora_alpha=alpha, task_type=task_type)


def has_lora_tensors(tensors: list[PlannedTensor]) -> bool:
    return any(_LORA.match(t.name) for t in tensors)


def is_adapter_only(tensors: list[PlannedTensor]) -> bool:
    """Only LoRA tensors, no base weights: what verl's ``checkpoint.save_lora_only=True`` saves."""
    return bool(tensors) and all(_LORA.match(t.name) for t in tensors)


def lora_module(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of a LoRA tensor name, ``None`` for any other tensor."""
    m = _LORA.match(name)
    return (m["module"], m["which"]) if m else None


def peft_base_names(base: list[PlannedTensor], targets: Collection[str]) -> list[PlannedTensor]:
    """Base model tensors named as a PEFT-wrapped model's state dict names them: ``base_model.model.<name>``,
    and ``<module>.base_layer.weight`` for each LoRA target module (``targets``: names without the prefix)."""
    renamed = []
    for t in base:
        module = t.name.removesuffix(".weight")
        name = (
            f"{PEFT_PREFIX}{module}.base_layer.weight"
            if module in targets and t.name.endswith(".weight")
            else PEFT_PREFIX + t.name
        )
        renamed.append(PlannedTensor(name, t.shape, t.dtype, t.source))
    return renamed
