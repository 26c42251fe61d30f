"""LoRA checkpoints (PEFT names) -> base weights plus an adapter, or merged weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.lora import LORA_META, PEFT_PREFIX, is_adapter_only, lora_module
from merge_pipeline.plan import Computed, LoraInfo, PlannedTensor


@dataclass
class LoraSplit:
    base: list[PlannedTensor]  # HF names of the base model (merged when asked)
    adapter: list[PlannedTensor]  # PEFT adapter names, as ``adapter_model.safetensors`` stores them
    target_modules: list[str]


def split_lora(tensors: list[PlannedTensor], info: LoraInfo, *, merge: bool, where) -> LoraSplit:
    """Separate adapter tensors from base weights; with ``merge``, fold W + (alpha/r)·B·A into W."""
    by_name = {t.name: t for t in tensors}
    pairs: dict[str, dict[str, PlannedTensor]] = {}
    base: list[PlannedTensor] = []
    for t in tensors:
        if found := lora_module(t.name):
            module, which = found
            pairs.setdefault(module, {})[which] = t
    adapter_only = is_adapter_only(tensors)
    if adapter_only and merge:
        raise MergeError(
            where,
            "holds only LoRA tensors (checkpoint.save_lora_only): --merge-lora needs the base model, pass --hf_model_path BASE",
        )
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise MergeError(where, f"LoRA module {module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        if not adapter_only and f"{module}.base_layer.weight" not in by_name:
            raise MergeError(where, f"LoRA module {module} has no base_layer.weight")
        _check_lora_shapes(module, by_name.get(f"{module}.base_layer.weight"), pair["A"], pair["B"], info.r, where)

    scale = info.lora_alpha / info.r
    for t in tensors:
        if lora_module(t.name):
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


def _check_lora_shapes(
    module: str, weight: PlannedTensor | None, a: PlannedTensor, b: PlannedTensor, r: int, where: Path
) -> None:
    """A is r x in and B is out x r for the base weight's out x in: anything else merges garbage.

    ``weight`` is None for an adapter-only checkpoint; its base is checked where it is read.
    """
    if len(a.shape) != 2 or len(b.shape) != 2 or (weight is not None and len(weight.shape) != 2):
        raise MergeError(
            where,
            f"LoRA module {module}: lora_A {a.shape}, lora_B {b.shape} and base weight {weight and weight.shape} must all be matrices",
        )
    if a.shape[0] != r or b.shape[1] != r:
        raise MergeError(
            where / LORA_META,
            f"says r={r} but {a.name} is {a.shape} and {b.name} is {b.shape} (A is r x in, B is out x r)",
        )
    if weight is not None and (b.shape[0], a.shape[1]) != weight.shape:
        raise MergeError(
            where,
            f"LoRA module {module}: lora_B {b.shape} @ lora_A {a.shape} does not fit the base weight {weight.shape} (A is r x in, B is out x r)",
        )


def model_tensors(tensors: list[PlannedTensor]) -> list[PlannedTensor]:
    """The model's tensors under the names a merge writes them: adapter tensors left out, PEFT's names undone."""
    return [PlannedTensor(_base_name(t.name), t.shape, t.dtype, t.source) for t in tensors if not lora_module(t.name)]


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
