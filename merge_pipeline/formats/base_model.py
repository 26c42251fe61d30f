"""A LoRA-only checkpoint (verl's ``checkpoint.save_lora_only``) completed with its base model's weights.

The base model folder (``--hf_model_path``) is the original Hugging Face model LoRA training left
unchanged; its safetensors are read like any consolidated folder (``formats/safetensors_folder/reader.py``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.safetensors_folder.reader import read_hf_weights
from merge_pipeline.hf.lora import PEFT_PREFIX, lora_module, peft_base_names
from merge_pipeline.plan import CheckpointPlan, closed_on_failure


def with_base_weights(plan: CheckpointPlan, base_dir: Path) -> CheckpointPlan:
    """An adapter-only plan completed with the base model's weights, read from ``base_dir`` (``--hf_model_path``).

    The base tensors get the names a PEFT-wrapped model gives them (``<module>.base_layer.weight``
    for a LoRA target), so the plan reads as a full LoRA checkpoint. Every target's base weight
    must exist with the shape the adapter's B·A has; the whole key set is checked against the
    architecture later (``check_against_architecture``), since these names do not come from the checkpoint.
    """
    if not base_dir.is_dir():
        raise MergeError(
            base_dir, "--hf_model_path: not a directory" if base_dir.exists() else "--hf_model_path: does not exist"
        )
    base, files = read_hf_weights(base_dir)
    with closed_on_failure(files):
        lora_shapes: dict[str, dict[str, tuple[int, ...]]] = {}  # module (no PEFT prefix) -> {"A": shape, "B": shape}
        for t in plan.tensors:
            module, which = lora_module(t.name)
            lora_shapes.setdefault(module.removeprefix(PEFT_PREFIX), {})[which] = t.shape
        by_name = {t.name: t for t in base}
        missing = sorted(f"{module}.weight" for module in lora_shapes if f"{module}.weight" not in by_name)
        if missing:
            raise MergeError(
                base_dir,
                f"no base weight for the LoRA target {missing[0]} ({len(missing)} missing): not the base model this run trained",
            )
        for module, pair in lora_shapes.items():
            t = by_name[f"{module}.weight"]
            expected = (
                (pair["B"][0], pair["A"][1]) if set(pair) == {"A", "B"} else None
            )  # a lone A or B: split_lora names it
            if expected and tuple(t.shape) != expected:
                raise MergeError(
                    t.source.runs[0].file.path,
                    f"{t.name} has shape {tuple(t.shape)} but the LoRA adapter expects {expected}: not the base model this run trained",
                )
        renamed = peft_base_names(base, lora_shapes)
    # The config and tokenizer stay the checkpoint's; load_model_config falls back to the base folder's.
    layout = {**plan.layout, "base_model": str(base_dir)}
    return replace(
        plan, tensors=renamed + plan.tensors, files=plan.files + files, check_against_architecture=True, layout=layout
    )
