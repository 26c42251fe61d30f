"""Where a checkpoint folder sits, named as the trainer that saved it names it: one value for the whole tool.

``formats.checkpoint_name`` finds it from the step folders the readers declare; the merge records it in
``merge_manifest.json`` (``source.checkpoint``), and the model card and the Hub upload read it from there.
Dagster's partition keys are these names (``watch/partitions.checkpoint_key`` parses one, by the same declarations).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath

STEP_ROLE = "model"  # the role of a checkpoint saved in the step folder itself (no role folder names it)


@dataclass(frozen=True)
class CheckpointName:
    role: str  # actor, critic, policy; STEP_ROLE for a save in the step folder itself
    run: str | None = None  # the folder holding the step folders
    step_folder: str | None = None  # as its stack writes the step: global_step_100, step-10, iter_0000100
    step: int | None = None
    writer: str | None = None  # the stack that saves such step folders: verl, torchtitan, Megatron-LM, ...

    @classmethod
    def from_manifest(cls, source: dict) -> CheckpointName:
        """The name a manifest's ``source`` records; a folder merged before it was recorded: its role folder only."""
        role_dir = PurePath(source["role_dir"])  # every manifest names its source folder (TypeError if garbled)
        if "checkpoint" in source:
            return cls(**source["checkpoint"])
        return cls(source.get("role") or role_dir.name)

    @property
    def path(self) -> PurePosixPath:
        """Where the folder sits below its watched root, and its merged folder below the output root."""
        return PurePosixPath(str(self))

    def __str__(self) -> str:
        """``<run>/<step folder>[/<role>]``, as the partition key reads; the role alone in no step folder."""
        if self.step_folder is None:
            return self.role
        place = [self.run, self.step_folder] if self.run else [self.step_folder]
        return "/".join(place if self.role == STEP_ROLE else [*place, self.role])
