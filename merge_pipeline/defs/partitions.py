"""One dynamic partition per checkpoint role folder, keyed ``<run_name>/global_step_<N>/<role>``.

The SFT trainer has no role folders: it saves the model straight into ``global_step_<N>/``. Its key
has no role part (``<run_name>/global_step_<N>``) and its role is ``model``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

import dagster as dg

from merge_pipeline.errors import MergeError

checkpoint_partitions = dg.DynamicPartitionsDefinition(name="checkpoints")

ROLES = ("actor", "critic")
# Exactly what verl writes: ASCII digits, no leading zeros. Only these names round-trip through a
# partition key (global_step_007 or global_step_٣ would parse to a step whose folder is another).
STEP_DIR = re.compile(r"global_step_(0|[1-9][0-9]*)")  # use fullmatch: "$" would let a trailing newline in
STEP_ROLE = "model"  # the role of a checkpoint saved in the step folder itself (SFT trainer)


@dataclass(frozen=True)
class CheckpointKey:
    """A partition key, parsed. ``run_name`` is the trainer folder's path below its watched root."""

    run_name: str
    step: int
    role: str

    def __str__(self) -> str:
        step_key = f"{self.run_name}/global_step_{self.step}"
        return step_key if self.role == STEP_ROLE else f"{step_key}/{self.role}"

    @property
    def path(self) -> PurePosixPath:
        """Where this role folder sits below a root (and its merged folder below the output root)."""
        return PurePosixPath(str(self))

    @classmethod
    def parse(cls, key: str) -> CheckpointKey:
        parts = key.rsplit("/", 2)
        if len(parts) == 3 and (step := STEP_DIR.fullmatch(parts[1])) and parts[2] in ROLES and _is_run_name(parts[0]):
            return cls(parts[0], int(step.group(1)), parts[2])
        run_name, _, step_dir = key.rpartition("/")
        if (step := STEP_DIR.fullmatch(step_dir)) and _is_run_name(run_name):
            return cls(run_name, int(step.group(1)), STEP_ROLE)
        raise MergeError(
            None,
            f"partition key {key!r} is not <run_name>/global_step_<N>/<{'|'.join(ROLES)}> or <run_name>/global_step_<N>",
        )


def _is_run_name(name: str) -> bool:
    """A plain relative path: no empty, '.' or '..' parts, nothing a join could escape the root with."""
    path = PurePosixPath(name)
    return str(path) == name and bool(path.parts) and not path.is_absolute() and ".." not in path.parts
