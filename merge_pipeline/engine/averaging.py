"""Averaging checkpoints: one output plan whose every tensor is the weighted average of the
inputs' tensor of the same name, computed while it is written.

Each input is planned as a merge of it alone would plan it (``pipeline.prepare``): names after LoRA
folding and tying, the value head, inert tensors. Here the inputs are checked to be one architecture
(the same names and shapes; the first difference is one line), and the output plan of the reference
input (the newest: its config and tokenizer are the folder's) gets an ``AveragedSource`` for each tensor.

``AveragedSource`` reads the K inputs' planned sources in lockstep, in units of ``READ_PIECE_BYTES``:
each unit is widened to the accumulation dtype, multiplied by its weight, and added, in input order.
Every step is one correctly rounded elementwise operation (no fused multiply-add), so the result does
not depend on how the tensor is cut: it is bit-identical to ``sum(w_k * x_k.to(float32))`` over whole
tensors, in the same order. The writer casts each unit to the output dtype (round to nearest even).
Memory: per input one unit plus what its source holds (one read piece, or the whole tensor where the
reader builds it: a dim > 0 concatenation, a LoRA fold), and two accumulator units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from merge_pipeline.engine.outputs import (
    OutputPlan,
    _split_shards,  # the one HF shard split (fp8.py uses it the same way)
    auto_config_dtype,
)
from merge_pipeline.engine.safetensors_writer import OutputTensor
from merge_pipeline.errors import MergeError, shown_path
from merge_pipeline.hf.fp8 import SCALE_SUFFIX
from merge_pipeline.hf.safetensors import exact_common_dtype
from merge_pipeline.plan import READ_PIECE_BYTES, CheckpointPlan, PlannedTensor, dtype_name, regrouped

BACKEND = "average"  # the averaged plan's backend, in the manifest and the resume key


@dataclass(frozen=True)
class AveragedInput:
    """One input as a merge of it alone plans it, and its weight."""

    plan: CheckpointPlan
    outputs: OutputPlan
    weight: float


@dataclass(frozen=True)
class AveragedSource:
    """A ``TensorSource``: the weighted sum of the inputs' tensors, unit by unit (see the module's doc)."""

    name: str
    inputs: tuple[PlannedTensor, ...]
    weights: tuple[float, ...]
    accumulate: torch.dtype
    paths: tuple[Path, ...]  # each input's folder, to name one that disagrees

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        first = self.inputs[0]
        itemsize = self.accumulate.itemsize if first.dtype.is_floating_point else first.dtype.itemsize
        unit = max(1, min(first.numel, READ_PIECE_BYTES // itemsize))
        buffers = [torch.empty(unit, dtype=t.dtype) for t in self.inputs]
        streams = [regrouped(t.source.pieces(), buffer) for t, buffer in zip(self.inputs, buffers, strict=True)]
        units = _lockstep(streams, self.name)
        if not first.dtype.is_floating_point:
            yield from self._equal(units, buffers)
            return
        total, term = torch.empty(unit, dtype=self.accumulate), torch.empty(unit, dtype=self.accumulate)
        for n in units:
            out, part = total[:n], term[:n]
            out.copy_(buffers[0][:n]).mul_(self.weights[0])
            for buffer, weight in zip(buffers[1:], self.weights[1:], strict=True):
                out.add_(part.copy_(buffer[:n]).mul_(weight))
            yield out

    def _equal(self, units: Iterator[int], buffers: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """An integer tensor (a buffer) has no average: it must be the same in every input."""
        for n in units:
            for path, buffer in zip(self.paths[1:], buffers[1:], strict=True):
                if not torch.equal(buffer[:n], buffers[0][:n]):
                    raise MergeError(
                        path,
                        f"{self.name} ({dtype_name(self.inputs[0].dtype)}) differs from {self.paths[0]}'s: integer tensors are not averaged",
                    )
            yield buffers[0][:n]


def _lockstep(streams: list[Iterator[int]], name: str) -> Iterator[int]:
    """The element counts of the inputs' units, all equal (their shapes were checked)."""
    while True:
        counts = [next(stream, None) for stream in streams]
        if all(c is None for c in counts):
            return
        if len(set(counts)) != 1:
            raise RuntimeError(f"{name}: the inputs' sources gave different element counts {counts}")
        yield counts[0]


def average_plan(
    inputs: Sequence[AveragedInput],
    reference: Path,
    *,
    dtype: torch.dtype | None,
    accumulate: str,
    max_shard_size: str | int,
) -> tuple[CheckpointPlan, OutputPlan]:
    """The plan of the average: ``reference`` (one of the inputs' folders) gives the tensor order and
    every decision but the dtypes; ``dtype``: the output dtype of floating tensors, None: the inputs' own
    (the narrowest holding each input's exactly where they differ); ``accumulate``: float32 or float64."""
    accumulate = getattr(torch, accumulate)
    ref = next((i for i in inputs if i.plan.role_dir == reference), None)
    if ref is None:
        raise MergeError(reference, "is not one of the inputs to average")
    for one in inputs:
        _refuse_unaveraged(one)
    model = [t for shard in ref.outputs.shards for t in shard.tensors]
    by_input = [_same_architecture(one, ref, model) for one in inputs]
    tensors = [
        _averaged(t.planned.name, [found[t.planned.name] for found in by_input], inputs, dtype, accumulate)
        for t in model
    ]
    files = [f for one in inputs for f in one.plan.files]
    plan = CheckpointPlan(
        BACKEND,
        ref.plan.role_dir,
        ref.plan.hf_dir,
        [t.planned for t in tensors],
        files,
        is_value_model=ref.plan.is_value_model,
        lora=ref.plan.lora,
        check_against_architecture=False,  # each input was checked as its own merge would be
        layout={
            "averaged_inputs": [
                # a store input by its URL, not its local view's path (gone once the merge ends)
                {"path": shown_path(one.plan.role_dir), "backend": one.plan.backend, "weight": one.weight}
                for one in inputs
            ],
            "accumulate": dtype_name(accumulate),
        },
    )
    outputs = dataclasses.replace(
        ref.outputs,
        shards=_split_shards(tensors, max_shard_size),
        config_dtype=auto_config_dtype(t.dtype for t in tensors),
    )
    return plan, outputs


def _refuse_unaveraged(one: AveragedInput) -> None:
    """What has no meaningful average: a LoRA adapter kept apart (the mean of the A and B matrices is
    not the mean of the updates B @ A) and quantized weights (their scales differ per input)."""
    where = one.plan.role_dir
    if one.outputs.adapter is not None:
        raise MergeError(
            where,
            "holds a LoRA adapter: averaging its A and B matrices is not averaging its updates; pass --merge-lora to average the folded weights",
        )
    for t in one.outputs.planned_tensors:
        if (t.dtype.is_floating_point and t.dtype.itemsize == 1) or t.name.endswith(SCALE_SUFFIX):
            raise MergeError(
                where, f"{t.name} is quantized ({dtype_name(t.dtype)}): averaging takes unquantized weights"
            )


def _same_architecture(one: AveragedInput, ref: AveragedInput, model: list[OutputTensor]) -> dict[str, PlannedTensor]:
    """``one``'s tensors by name, if it has exactly the reference's names and shapes; else the first difference."""
    found = {t.name: t for t in one.outputs.planned_tensors}
    where, theirs = one.plan.role_dir, ref.plan.role_dir
    for t in model:
        name, shape = t.planned.name, t.planned.shape
        if name not in found:
            raise MergeError(where, f"has no {name}, which {theirs} has: averaging needs one architecture")
        if found[name].shape != shape:
            raise MergeError(
                where,
                f"{name} has shape {list(found[name].shape)}, {list(shape)} in {theirs}: averaging needs one architecture",
            )
    extra = next((name for name in found if name not in {t.planned.name for t in model}), None)
    if extra is not None:
        raise MergeError(where, f"has {extra}, which {theirs} has not: averaging needs one architecture")
    return found


def _averaged(
    name: str,
    tensors: list[PlannedTensor],
    inputs: Sequence[AveragedInput],
    dtype: torch.dtype | None,
    accumulate: torch.dtype,
) -> OutputTensor:
    stored = [t.dtype for t in tensors]
    source = AveragedSource(
        name, tuple(tensors), tuple(one.weight for one in inputs), accumulate, tuple(i.plan.role_dir for i in inputs)
    )
    if not all(d.is_floating_point for d in stored):
        if len(set(stored)) != 1:
            other = next(i for i, d in enumerate(stored) if d != stored[0])
            raise MergeError(
                inputs[other].plan.role_dir,
                f"{name} is {dtype_name(stored[other])}, {dtype_name(stored[0])} in {inputs[0].plan.role_dir}: integer tensors are not averaged",
            )
        return OutputTensor(PlannedTensor(name, tensors[0].shape, stored[0], source), stored[0])
    if dtype is None:
        dtype = stored[0]
        for d in stored[1:]:
            dtype = exact_common_dtype(dtype, d)
    return OutputTensor(PlannedTensor(name, tensors[0].shape, accumulate, source), dtype)
