"""Did training change anything? A merged folder's weights against other folders (the previous step, the base model).

Streams: one tensor of each folder in memory at a time (``safe_open``, closed after each tensor), so
memory is bounded by the largest tensor, whatever the model's size. Per tensor: its norm, NaN / Inf counts, and the relative
change ``||new - ref|| / ||ref||`` against each reference that holds a tensor of that name and shape.
``merge-pipeline diff`` and Dagster's ``step_report`` both build it here and print the same table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.folder_checks import weight_files
from merge_pipeline.hf.safetensors import open_safetensors

_LAYER = re.compile(r"\.(\d+)\.")


@dataclass
class TensorChange:
    name: str
    shape: tuple[int, ...]
    norm: float
    nan: int
    inf: int
    relative_change: dict[str, float | None]  # reference label -> change; None: the reference lacks it (or its shape)

    @property
    def layer(self) -> int | None:
        found = _LAYER.search(self.name)
        return int(found.group(1)) if found else None

    @property
    def kind(self) -> str:
        """The tensor's name without its layer number: ``model.layers.self_attn.q_proj.weight``."""
        return _LAYER.sub(".", self.name, count=1)


@dataclass
class StepDiff:
    references: list[str]  # labels, in column order
    tensors: list[TensorChange] = field(default_factory=list)
    only_in_reference: dict[str, list[str]] = field(default_factory=dict)

    def identical_to(self, label: str) -> bool:
        """Bit for bit the reference's weights: the same names, and every tensor unchanged."""
        return not self.only_in_reference[label] and all(t.relative_change[label] == 0.0 for t in self.tensors)

    @property
    def nan(self) -> int:
        return sum(t.nan for t in self.tensors)

    @property
    def inf(self) -> int:
        return sum(t.inf for t in self.tensors)

    def max_change(self, label: str) -> float | None:
        changes = [c for t in self.tensors if (c := t.relative_change[label]) is not None]
        return max(changes, default=None)


def diff_folders(folder: Path, references: dict[str, Path]) -> StepDiff:
    """``folder``'s model weights, tensor by tensor, against each reference folder's."""
    mine = _tensor_files(folder)
    theirs = {label: _tensor_files(path) for label, path in references.items()}
    diff = StepDiff(
        list(references), only_in_reference={label: sorted(set(t) - set(mine)) for label, t in theirs.items()}
    )
    for name in sorted(mine):
        tensor = _read(mine[name], name)
        wide = tensor.to(torch.float32)  # exact for bf16 / fp16 / fp32; half the memory of float64
        diff.tensors.append(
            TensorChange(
                name,
                tuple(tensor.shape),
                float(torch.linalg.vector_norm(wide)),
                int(torch.isnan(wide).sum()),
                int(torch.isinf(wide).sum()),
                {label: _change(tensor, wide, files, name) for label, files in theirs.items()},
            )
        )
        del tensor, wide  # one tensor (and one of a reference) alive at a time
    return diff


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the shard holding it, for every model*.safetensors of ``folder`` (headers validated)."""
    files = weight_files(folder)
    if not files:
        raise MergeError(folder, "no model*.safetensors weights to compare (not a merged Hugging Face folder)")
    return {name: folder / filename for filename, header in files.items() for name in header}


def _read(path: Path, name: str) -> torch.Tensor:
    # Opened per tensor: safe_open maps the whole file, and the pages read stay resident until it is
    # closed; closing after each tensor keeps memory at one tensor, not one shard (or one model).
    with open_safetensors(path) as f:
        return f.get_tensor(name)


def _change(tensor: torch.Tensor, wide: torch.Tensor, files: dict[str, Path], name: str) -> float | None:
    if name not in files:
        return None
    other = _read(files[name], name)
    if other.shape != tensor.shape:
        return None
    if other.dtype == tensor.dtype and torch.equal(other, tensor):
        return 0.0  # bit for bit: exactly zero, not a rounding of a small number
    other = other.to(torch.float32)
    return float(torch.linalg.vector_norm(wide - other) / torch.linalg.vector_norm(other).clamp_min(1e-30))


def markdown_table(diff: StepDiff) -> str:
    """One row per tensor: shape, norm, NaN / Inf, the relative change against each reference."""
    head = ["tensor", "shape", "norm", "NaN", "Inf", *(f"change vs {label}" for label in diff.references)]
    rows = [
        [
            t.name,
            "x".join(map(str, t.shape)) or "scalar",
            f"{t.norm:.4g}",
            str(t.nan),
            str(t.inf),
            *(_format_change(t.relative_change[label]) for label in diff.references),
        ]
        for t in diff.tensors
    ]
    lines = [f"| {' | '.join(head)} |", f"|{'---|' * 2}{'---:|' * (len(head) - 2)}"]
    return "\n".join(lines + [f"| {' | '.join(r)} |" for r in rows])


def _format_change(change: float | None) -> str:
    if change is None:
        return "absent"
    return "identical" if change == 0.0 else f"{change:.3e}"


def summary_lines(diff: StepDiff) -> list[str]:
    """What a person reads first: identical or not, the largest change, non-finite values."""
    lines = [f"{len(diff.tensors)} tensors, {diff.nan} NaN, {diff.inf} Inf"]
    for label in diff.references:
        if diff.identical_to(label):
            lines.append(f"vs {label}: bit-identical (training changed nothing, or LoRA was never folded)")
        else:
            missing = diff.only_in_reference[label]
            lines.append(
                f"vs {label}: largest relative change {_format_change(diff.max_change(label))}"
                + (f", {len(missing)} tensor(s) only in {label}" if missing else "")
            )
    return lines
