"""Prepare: open and validate the checkpoint and decide every output file, reading no tensor data.

One input, or the average of several (each planned as a merge of it alone). The model config is resolved
here once, and checked against the architecture it names; FP8 and quantization decide their files here too.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from merge_pipeline.engine.as_base import following_base
from merge_pipeline.engine.averaging import AveragedInput, average_plan
from merge_pipeline.engine.lora_merge import model_tensors
from merge_pipeline.engine.outputs import DTYPES, OutputPlan, plan_outputs
from merge_pipeline.engine.weight_format import formatted_outputs
from merge_pipeline.formats import open_checkpoint, weight_suffixes
from merge_pipeline.formats.base_model import with_base_weights
from merge_pipeline.hf.config import CheckpointConfig, ModelConfig
from merge_pipeline.hf.file_names import WEIGHT_SUFFIXES
from merge_pipeline.hf.fp8 import refuse_quantized
from merge_pipeline.hf.lora import is_adapter_only
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import CheckpointPlan
from merge_pipeline.store.url import is_store_url, spelled
from merge_pipeline.store.view import viewed
from merge_pipeline.workers.writing import Prepared

if TYPE_CHECKING:
    from merge_pipeline.hf.architecture import ExpectedTensors


def prepare(local_dir: str | Path, options: MergeOptions) -> Prepared:
    """Open and validate the checkpoint and decide every output file, reading no tensor data.

    The model config is resolved here, once: the readers that need it to plan ask the same one.
    With ``options.average_inputs``: the plan of their average (``_prepare_average``). ``local_dir`` and
    ``options.hf_model_path`` may be store URLs: read through local views, kept while the plan is
    (``CheckpointPlan.views``)."""
    if options.average_inputs:
        return _prepare_average(local_dir, options)
    return _prepare_one(local_dir, options)


def _prepare_one(local_dir: str | Path, options: MergeOptions, *, merged: bool = False) -> Prepared:
    views = contextlib.ExitStack()
    try:
        local_dir = views.enter_context(viewed(local_dir, weight_suffixes()))
        if options.hf_model_path and is_store_url(options.hf_model_path):
            options = replace(
                options, hf_model_path=str(views.enter_context(viewed(options.hf_model_path, WEIGHT_SUFFIXES)))
            )
        configs = CheckpointConfig.of(local_dir, options)
        plan = open_checkpoint(local_dir, options, configs, merged=merged)
    except BaseException:
        views.close()
        raise
    plan.views.enter_context(views)
    try:
        if options.hf_model_path and is_adapter_only(plan.tensors):
            plan = with_base_weights(plan, Path(options.hf_model_path).absolute())
        config = configs.load(plan.hf_dir)
        options = following_base(options, config)
        if options.dtype == "fp8":
            refuse_quantized(plan.tensors, plan.role_dir)  # said before the architecture check names the scales
        expected = _architecture_tensors(plan, config, options) if plan.check_against_architecture else None
        if expected is not None:
            plan = _with_inert_tensors(plan, expected)
        outputs = plan_outputs(plan, config, options)
        if expected is not None:
            _check_against_architecture(outputs, expected, config)
        outputs = formatted_outputs(outputs, options, config, plan.role_dir)
    except BaseException:
        plan.close()
        raise
    return Prepared(plan, config, outputs)


def _prepare_average(local_dir: str | Path, options: MergeOptions) -> Prepared:
    """Averaging: each input (a role folder or a merged HF folder) planned as a merge of it
    alone, then one plan whose tensors are their weighted average, computed while written; ``local_dir``,
    one of the inputs, gives the config and the side files. The merge sequence runs on it unchanged."""
    # the cast and the quantization come after the sum
    alone = replace(options, average_inputs=(), average_weights=(), dtype="auto", quantize=None, quantize_ignore=())
    inputs: list[AveragedInput] = []
    configs: dict[Path, ModelConfig] = {}
    try:
        for path, weight in zip(options.average_inputs, options.average_weights, strict=True):
            one = _prepare_one(path, alone, merged=True)
            inputs.append(AveragedInput(one.plan, one.outputs, weight))
            configs[one.plan.role_dir] = one.config
        # local_dir names one of the inputs: its folder as planned (a store input's is its local view)
        named, wanted = [spelled(path) for path in options.average_inputs], spelled(local_dir)
        reference = inputs[named.index(wanted)].plan.role_dir if wanted in named else Path(local_dir).absolute()
        plan, outputs = average_plan(
            inputs,
            reference,
            dtype=DTYPES.get(options.dtype),
            accumulate=options.average_accumulate,
            max_shard_size=options.max_shard_size,
        )
        options = following_base(options, configs[reference])
        outputs = formatted_outputs(outputs, options, configs[reference], reference)  # the average, quantized
    except BaseException:
        for one in inputs:
            one.plan.close()
        raise
    for one in inputs:  # a store input's view lives as long as the average's plan reads through it
        plan.views.enter_context(one.plan.views.pop_all())
    return Prepared(plan, configs[reference], outputs)


# Imported in the functions below: hf.architecture imports transformers (~1.3 s, ~35 MB), which FSDP never needs.


def _architecture_tensors(plan: CheckpointPlan, config: ModelConfig, options: MergeOptions) -> ExpectedTensors:
    """The tensors (names, shapes) of the architecture config.json describes."""
    from merge_pipeline.hf.architecture import expected_tensors

    return expected_tensors(
        config.path.parent, value_model=plan.writes_value_model(options), trust_remote_code=options.trust_remote_code
    )


def _with_inert_tensors(plan: CheckpointPlan, expected: ExpectedTensors) -> CheckpointPlan:
    """The plan with the expected tensors no checkpoint stores because they cannot change the output
    (e.g. a zero-width shared expert), as zeros: so from_pretrained misses nothing."""
    from merge_pipeline.hf.architecture import inert_absent_tensors

    inert = inert_absent_tensors(model_tensors(plan.tensors), expected)
    return replace(plan, tensors=plan.tensors + inert) if inert else plan


def _check_against_architecture(outputs: OutputPlan, expected: ExpectedTensors, config: ModelConfig) -> None:
    """Key set and every shape against the architecture, so nothing is dropped silently and nothing
    the model needs is left out."""
    from merge_pipeline.hf.architecture import check_plan_against_architecture

    check_plan_against_architecture(outputs.planned_tensors, expected, config.path)
