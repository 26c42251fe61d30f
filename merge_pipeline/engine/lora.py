"""LoRA checkpoints (PEFT names) -> base weights plus an adapter, or merged weights.

A PEFT-wrapped model's state dict names its tensors
``base_model.model.<module>.base_layer.weight``, ``<module>.lora_A.<adapter>.weight`` and
``<module>.lora_B.<adapter>.weight``; everything else is ``base_model.model.<name>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from merge_pipeline.engine.plan import Computed, LoraInfo, PlannedTensor
from merge_pipeline.errors import MergeError

PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?:(?P<adapter>[^.]+)\.)?weight$")


@dataclass
class LoraSplit:
    base: list[PlannedTensor]  # HF names of the base model (merged when asked)
    adapter: list[PlannedTensor]  # PEFT adapter names, as ``adapter_model.safetensors`` stores them
    target_modules: list[str]


def has_lora_tensors(tensors: list[PlannedTensor]) -> bool:
    return any(_LORA.match(t.name) for t in tensors)


def split_lora(tensors: list[PlannedTensor], info: LoraInfo, *, merge: bool, where) -> LoraSplit:
    """Separate adapter tensors from base weights; with ``merge``, fold W + (alpha/r)·B·A into W."""
    by_name = {t.name: t for t in tensors}
    pairs: dict[str, dict[str, PlannedTensor]] = {}
    base: list[PlannedTensor] = []
    for t in tensors:
        if m := _LORA.match(t.name):
            pairs.setdefault(m["module"], {})[m["which"]] = t
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise MergeError(where, f"LoRA module {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        if f"{module}.base_layer.weight" not in by_name:
            raise MergeError(where, f"LoRA module {module} has no base_layer.weight")

    scale = info.lora_alpha / info.r
    for t in tensors:
        if _LORA.match(t.name):
            continue
        name = _base_name(t.name)
        module = t.name.removesuffix(".base_layer.weight")
        if merge and module in pairs:
            base.append(_merged(name, t, pairs[module]["A"], pairs[module]["B"], scale))
        else:
            base.append(PlannedTensor(name, t.shape, t.dtype, t.source))

    adapter = []
    if not merge:
        for module, pair in pairs.items():
            for which in ("A", "B"):
                t = pair[which]
                adapter.append(PlannedTensor(f"{module}.lora_{which}.weight", t.shape, t.dtype, t.source))
    targets = sorted({module.rsplit(".", 1)[-1] for module in pairs})
    return LoraSplit(base, adapter, targets)


def lora_module(name: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of a LoRA tensor name, ``None`` for any other tensor."""
    m = _LORA.match(name)
    return (m["module"], m["which"]) if m else None


def _base_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _merged(name: str, weight: PlannedTensor, a: PlannedTensor, b: PlannedTensor, scale: float) -> PlannedTensor:
    def build() -> torch.Tensor:
        # Exactly PEFT's merge on CPU: delta = (B @ A) * scaling, in fp32 for half dtypes, then W += delta.
        w = weight.load()
        compute = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        delta = (b.load().to(compute) @ a.load().to(compute)) * scale
        return w + delta.to(w.dtype)

    return PlannedTensor(name, weight.shape, weight.dtype, Computed(build))
