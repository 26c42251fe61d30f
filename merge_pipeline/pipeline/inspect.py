"""Inspect and test: what a checkpoint holds, from metadata only (``describe``, ``checkpoint_facts``), and
what it merges to against a reference folder (``compare``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from merge_pipeline.engine.as_base import following_base
from merge_pipeline.engine.outputs import config_dtype_for, plan_outputs
from merge_pipeline.engine.verify import Comparison, compare_with_reference
from merge_pipeline.engine.weight_format import formatted_outputs
from merge_pipeline.errors import MergeError, shown_path
from merge_pipeline.formats import checkpoint_name, open_checkpoint, weight_suffixes
from merge_pipeline.hf.config import CheckpointConfig, ModelConfig
from merge_pipeline.hf.file_names import WEIGHT_SUFFIXES
from merge_pipeline.hf.lora import has_lora_tensors
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.plan import CheckpointPlan, dtype_name
from merge_pipeline.store.view import viewed


def describe(local_dir: str | Path, options: MergeOptions) -> dict:
    """``inspect``: what a checkpoint holds, from metadata only."""
    with viewed(local_dir, weight_suffixes()) as folder:
        configs = CheckpointConfig.of(folder, options)
        with open_checkpoint(folder, options, configs) as plan:
            try:
                config = configs.load(plan.hf_dir)
            except MergeError as exc:  # a checkpoint without a config is still described
                config = exc
            return checkpoint_facts(plan, options, config)


def checkpoint_facts(
    plan: CheckpointPlan, options: MergeOptions, config: ModelConfig | MergeError, decided: dict | None = None
) -> dict:
    """What an opened checkpoint is: ``inspect`` prints these, Dagster's ``parallel_config`` shows them.

    ``config``: the config the merge resolved, or why there is none; ``decided``: a finished merge's
    manifest ``decisions``, whose FP8 and quantization plans are shown as made, not planned again."""
    dtypes = Counter()
    for t in plan.tensors:
        dtypes[dtype_name(t.dtype)] += t.numel
    if isinstance(config, MergeError):
        architecture, tied, config = f"unknown ({config.problem})", None, None
    else:
        architecture, tied = config.architecture, config.tie_word_embeddings
    return {
        "backend": plan.backend,
        "role": checkpoint_name(plan.role_dir).role,
        "path": shown_path(plan.role_dir),
        **plan.layout,
        "architecture": architecture,
        "parameters": plan.parameter_count,
        "tensors": len(plan.tensors),
        "dtypes": dict(dtypes),
        "config_dtype": dtype_name(config_dtype_for(plan.tensors, options)),  # what --dtype writes to config.json
        "bytes": sum(t.nbytes() for t in plan.tensors),
        "lora": has_lora_tensors(plan.tensors),
        "value_model": plan.is_value_model,
        "tied_word_embeddings": tied,
        "files": [{"path": shown_path(f.path), "size": f.size} for f in plan.files],
        **(_output_plans(plan, config, options) if decided is None else _planned(decided)),
    }


def _output_plans(plan: CheckpointPlan, config: ModelConfig | None, options: MergeOptions) -> dict:
    """``inspect --dtype fp8`` / ``--quantize``: what a merge would quantize and keep (after LoRA folding and tying)."""
    if config is None:
        return {}
    options = following_base(options, config)
    if options.dtype != "fp8" and not options.quantize:
        return {}
    outputs = formatted_outputs(plan_outputs(plan, config, options), options, config, plan.role_dir)
    return (
        {"fp8": outputs.fp8.summary()} if options.dtype == "fp8" else {"quantization": outputs.quantization.summary()}
    )


def _planned(decisions: dict) -> dict:
    return {name: decisions[name] for name in ("fp8", "quantization") if name in decisions}


def compare(
    local_dir: str | Path, reference_dir: str | Path, options: MergeOptions, *, atol: float = 0.0
) -> Comparison:
    """``test``: what the checkpoint merges to, tensor by tensor against a reference HF folder (or a merged
    folder in a store, refused while its ``merge_manifest.json`` is missing)."""
    with viewed(reference_dir, WEIGHT_SUFFIXES, merged=True) as reference, prepare(local_dir, options) as prepared:
        return compare_with_reference(prepared.outputs, reference.absolute(), atol=atol)
