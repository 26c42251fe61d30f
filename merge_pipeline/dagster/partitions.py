"""One dynamic partition per checkpoint folder, keyed ``<run_name>/<step folder>[/<role>]``.

The readers say how each training stack names its step folders and which role folders it saves
inside them (``pipeline.step_folders``). verl's keys are ``<run_name>/global_step_<N>/<actor|critic>``;
a checkpoint saved in the step folder itself (verl's SFT trainer, a DeepSpeed tag, torchtitan, the
HF Trainer) has no role part (``<run_name>/step-<N>``) and its role is ``model``. The key keeps the step folder's name
as it is on disk, so it leads back to exactly that folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from merge_pipeline.checkpoint_name import STEP_ROLE
from merge_pipeline.errors import MergeError


@dataclass(frozen=True)
class CheckpointKey:
    """A partition key, parsed. ``run_name`` is the trainer folder's path below its watched root."""

    run_name: str
    step: int
    role: str
    step_dir: str  # the step folder's name, as its stack writes the step: global_step_100, iter_0000100

    def __str__(self) -> str:
        step_key = f"{self.run_name}/{self.step_dir}"
        return step_key if self.role == STEP_ROLE else f"{step_key}/{self.role}"

    @property
    def path(self) -> PurePosixPath:
        """Where this checkpoint folder sits below a root (and its merged folder below the output root)."""
        return PurePosixPath(str(self))

    @classmethod
    def parse(cls, key: str) -> CheckpointKey:
        # the step folder rules live with the readers (torch): imported on use, not by the location's load
        from merge_pipeline.pipeline import step_folder, step_folders

        parts = key.rsplit("/", 2)
        if len(parts) == 3 and (found := step_folder(parts[1])) and parts[2] in found[0].roles:
            if _is_run_name(parts[0]):
                return cls(parts[0], found[1], parts[2], parts[1])
        run_name, _, step_dir = key.rpartition("/")
        if (found := step_folder(step_dir)) and found[0].in_step_folder and _is_run_name(run_name):
            return cls(run_name, found[1], STEP_ROLE, step_dir)
        forms = [form for folder in step_folders() for form in folder.key_forms]
        raise MergeError(None, f"partition key {key!r} is not {' or '.join(forms)}")


def _is_run_name(name: str) -> bool:
    """A plain relative path: no empty, '.' or '..' parts, nothing a join could escape the root with."""
    path = PurePosixPath(name)
    return str(path) == name and bool(path.parts) and not path.is_absolute() and ".." not in path.parts
