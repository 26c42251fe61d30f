"""``test``: compare what a checkpoint merges to with a reference HF folder, tensor by tensor."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from merge_pipeline.engine.outputs import OutputPlan
from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.hf.file_names import INDEX, SINGLE_FILE
from merge_pipeline.hf.safetensors import open_safetensors
from merge_pipeline.plan import dtype_name


@dataclass
class Comparison:
    compared: int = 0
    missing: list[str] = field(default_factory=list)  # in the checkpoint, not in the reference
    unexpected: list[str] = field(default_factory=list)  # in the reference, not in the checkpoint
    mismatched: list[tuple[str, str]] = field(default_factory=list)  # (name, what differs)
    worst: list[tuple[float, str]] = field(default_factory=list)  # (max abs diff, name), largest first
    cast_to: set[str] = field(default_factory=set)  # the reference's dtypes ours were cast to before comparing

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)


def reference_files(reference_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of an HF folder (sharded or not)."""
    if not reference_dir.is_dir():
        raise MergeError(
            reference_dir,
            "reference folder is not a directory" if reference_dir.exists() else "reference folder does not exist",
        )
    index = reference_dir / INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise MergeError(index, "not a safetensors index: no 'weight_map' of tensor name -> file name")
        return {name: reference_dir / filename for name, filename in weight_map.items()}
    single = reference_dir / SINGLE_FILE
    if not single.is_file():
        raise MergeError(reference_dir, f"no {SINGLE_FILE} or {INDEX}")
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def compare_with_reference(
    outputs: OutputPlan, reference_dir: Path, *, atol: float = 0.0, worst: int = 5
) -> Comparison:
    files = reference_files(reference_dir)
    result = Comparison()
    ours = {t.planned.name: t for shard in outputs.shards for t in shard.tensors}
    result.missing = sorted(set(ours) - set(files))
    result.unexpected = sorted(set(files) - set(ours))
    diffs = []
    for name in sorted(set(ours) & set(files)):
        with open_safetensors(files[name]) as f:
            reference = f.get_tensor(name)
        mine = ours[name].planned.load()
        result.compared += 1
        if tuple(reference.shape) != ours[name].planned.shape:
            result.mismatched.append((name, f"shape {ours[name].planned.shape} vs reference {tuple(reference.shape)}"))
            continue
        if mine.dtype != reference.dtype:
            result.cast_to.add(dtype_name(reference.dtype))
        mine = mine.to(reference.dtype)  # compare in the reference's dtype, as a merge to it would write
        diff = (mine.double() - reference.double()).abs().max().item() if mine.numel() else 0.0
        diffs.append((diff, name))
        same_bytes = torch.equal(
            mine.contiguous().view(-1).view(torch.uint8), reference.contiguous().view(-1).view(torch.uint8)
        )
        if diff > atol or (atol == 0 and not same_bytes):  # atol 0 means bit-exact (NaN payloads and -0.0 included)
            result.mismatched.append((name, f"max abs diff {diff:.3g}"))
    result.worst = sorted(diffs, reverse=True)[:worst]
    return result
