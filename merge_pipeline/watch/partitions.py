"""One dynamic partition per checkpoint folder, keyed by its name (``checkpoint_name.CheckpointName``):
``<run>/<step folder>[/<role>]``.

The readers say how each training stack names its step folders and which role folders it saves
inside them (``pipeline.step_folders``). verl's keys are ``<run>/global_step_<N>/<actor|critic>``;
a checkpoint saved in the step folder itself (verl's SFT trainer, a DeepSpeed tag, torchtitan, the
HF Trainer) has no role part (``<run>/step-<N>``) and its role is ``model``. The key keeps the step
folder's name as it is on disk, so it leads back to exactly that folder.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from merge_pipeline.checkpoint_name import STEP_ROLE, CheckpointName
from merge_pipeline.errors import MergeError


def checkpoint_key(key: str) -> CheckpointName:
    """A partition key, parsed into the checkpoint's name (its writer included); ``MergeError`` naming the
    forms a key takes when it is none of them."""
    # the step folder rules live with the readers (torch): imported on use, not by the location's load
    from merge_pipeline.formats import step_folder, step_folders

    parts = key.rsplit("/", 2)
    if len(parts) == 3 and (found := step_folder(parts[1])) and parts[2] in found[0].roles:
        if _is_run_name(parts[0]):
            return CheckpointName(parts[2], parts[0], parts[1], found[1], found[0].stack)
    run, _, folder = key.rpartition("/")
    if (found := step_folder(folder)) and found[0].in_step_folder and _is_run_name(run):
        return CheckpointName(STEP_ROLE, run, folder, found[1], found[0].stack)
    forms = [form for stack in step_folders() for form in stack.key_forms]
    raise MergeError(None, f"partition key {key!r} is not {' or '.join(forms)}")


def _is_run_name(name: str) -> bool:
    """A plain relative path: no empty, '.' or '..' parts, nothing a join could escape the root with."""
    path = PurePosixPath(name)
    return str(path) == name and bool(path.parts) and not path.is_absolute() and ".." not in path.parts
