"""Format readers: each turns a role folder into a ``CheckpointPlan`` without loading tensor data.

A format is a package of this one, ``formats/<name>/``, whose ``reader`` module exposes ``READER`` (a
``Reader``): how to recognise its folders and plan them, and which trainers' step folders hold them and
when a save there is complete; its own helpers sit beside it. The helpers several formats share stay
here at the top. Adding a format means adding its package and its name to ``options.BACKENDS``; nothing
else here changes.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from merge_pipeline.checkpoint_name import STEP_ROLE, CheckpointName
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.step_folders import Completeness, Quiet, StepFolder, newest_change, tracker_vouches
from merge_pipeline.hf.config import CheckpointConfig
from merge_pipeline.options import BACKENDS, MergeOptions
from merge_pipeline.plan import CheckpointPlan, closed_on_failure

# Reader packages, in the order ``auto`` tries them: the first whose detect() says yes plans the folder.
# Their names are the --backend choices (options.BACKENDS, which the CLI and Dagster offer).
READERS = BACKENDS[1:]
# A reader's package is named by its backend, except where the --backend value users type says less.
MODULE_OF = {"hf": "safetensors_folder"}


def _never(step_dir: Path, stack: StepFolder) -> bool:
    return False


def _no_marker(folder: Path, step: int, stack: StepFolder, quiet: Quiet) -> Completeness | None:
    return None


@dataclass(frozen=True)
class Reader:
    """One checkpoint format: each reader module's ``READER``."""

    name: str  # the --backend value
    looks_for: str  # what detect() looks for, for the error when no reader recognises a folder
    detect: Callable[[Path], bool]
    # The plan of a role folder; the config is asked for only by readers that need it to plan.
    plan: Callable[[Path, MergeOptions, CheckpointConfig], CheckpointPlan]
    # Its files the plan streams tensor bytes from: in a store, read through ranged GETs, never downloaded.
    weight_suffixes: tuple[str, ...]
    # The step folders of the trainers that save this format, and whether one holds such a save
    # itself (not in a role folder: verl's SFT trainer, a DeepSpeed tag, torchtitan).
    step_folders: tuple[StepFolder, ...] = ()
    saved_in_step_folder: Callable[[Path, StepFolder], bool] = _never
    # Whether a save in one of those step folders is complete, and why; None: this format leaves no
    # marker there, so the next reader of that step folder is asked (the last word: its tracker, or the settle time).
    completeness: Callable[[Path, int, StepFolder, Quiet], Completeness | None] = _no_marker
    # An HF model folder (a merge's output) as an input to averaging: the hf reader's only.
    plan_model_folder: Callable[[Path], CheckpointPlan] | None = None


def reader(name: str) -> Reader:
    """The reader of ``--backend name``; imported only when asked for (Megatron's pulls in megatron-core types)."""
    if name not in READERS:
        raise MergeError(None, f"--backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    return importlib.import_module(f"{__name__}.{MODULE_OF.get(name, name)}.reader").READER


@functools.cache
def weight_suffixes() -> tuple[str, ...]:
    """Every reader's weight-file suffixes, each once: what a store's view leaves in the store (``store.view``)."""
    return tuple(dict.fromkeys(suffix for name in READERS for suffix in reader(name).weight_suffixes))


def step_folders() -> list[StepFolder]:
    """Every step folder some reader's trainers save in, each once."""
    return list(dict.fromkeys(folder for name in READERS for folder in reader(name).step_folders))


def step_folder(name: str) -> tuple[StepFolder, int] | None:
    """Which stack's step folder ``name`` is, and its step; None when it is no canonical step folder name."""
    for folder in step_folders():
        if step := folder.name.fullmatch(name):
            return folder, int(step.group(1))
    return None


def checkpoint_name(folder: Path) -> CheckpointName:
    """Where a checkpoint folder sits, by the step folders the readers declare: in a step folder's
    role folder (verl's ``global_step_<N>/actor``), or a step folder itself (``step-<N>``, ``iter_<N>``)."""
    if (found := step_folder(folder.parent.name)) and folder.name in found[0].roles:
        step_dir, role = folder.parent, folder.name
    elif (found := step_folder(folder.name)) and found[0].in_step_folder:
        step_dir, role = folder, STEP_ROLE
    else:
        return CheckpointName(folder.name)
    stack, step = found
    return CheckpointName(role, step_dir.parent.name or None, step_dir.name, step, stack.stack)


def _readers_of(stack: StepFolder) -> list[Reader]:
    return [r for r in map(reader, READERS) if stack in r.step_folders]


def saved_in_step_folder(step_dir: Path, stack: StepFolder) -> bool:
    """Whether the step folder itself is a checkpoint (what it holds may still be partial)."""
    return any(r.saved_in_step_folder(step_dir, stack) for r in _readers_of(stack))


def completeness(folder: Path, step: int, settle_seconds: float, *, now: float | None = None) -> Completeness:
    """Whether a checkpoint folder is completely saved, and why: the readers of its step folder are
    asked in ``READERS`` order; when none knows a marker, the stack's tracker beside the step folders
    (verl's ``latest_checkpointed_iteration.txt``) if written after the folder's last change, else
    nothing under the folder changed for the settle time."""
    newest = newest_change(folder)
    if newest is None:
        return Completeness(False, "no files yet", None)
    quiet = Quiet(settle_seconds, newest, (time.time() if now is None else now) - newest)
    stack = _stack_of(folder)
    for r in _readers_of(stack):
        if (answer := r.completeness(folder, step, stack, quiet)) is not None:
            return answer
    vouched, says = tracker_vouches(folder, step, stack, newest)
    return quiet.done(says) if vouched else quiet.settled(says)


def _stack_of(folder: Path) -> StepFolder:
    """The stack whose step folder ``folder`` is, or holds it; the first (verl's) for any other folder."""
    for candidate in (folder, folder.parent):
        if found := step_folder(candidate.name):
            return found[0]
    return step_folders()[0]


def detect_backend(role_dir: Path) -> str:
    for name in READERS:
        if reader(name).detect(role_dir):
            return name
    problem = misplaced_folder(role_dir) or "neither " + " nor ".join(reader(name).looks_for for name in READERS)
    raise MergeError(role_dir, problem)


def is_hf_model_folder(folder: Path) -> bool:
    """A Hugging Face model folder (a merge's output, a released model): config.json and safetensors weights."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def misplaced_folder(folder: Path) -> str | None:
    """What ``folder`` is when it is one of the common wrong answers to "which folder?", and what to
    pass instead: a step holding role folders, a trainer's run folder, or an already merged HF folder."""
    if is_hf_model_folder(folder):
        return "is already a merged Hugging Face folder (config.json, *.safetensors): nothing to merge"
    roles = _checkpoints_in(folder)
    if roles:
        return f"holds role folders {', '.join(roles)}: pass {folder / roles[0]}"
    steps = {found[1]: d.name for d in _subfolders(folder) if (found := step_folder(d.name))}  # any trainer's
    if steps:
        newest = folder / steps[max(steps)]
        roles = _checkpoints_in(newest)
        return f"a run folder: the newest step is {newest.name}: pass {newest / roles[0] if roles else newest}"
    return None


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    except OSError:
        return []


def _checkpoints_in(folder: Path) -> list[str]:
    """The names of ``folder``'s subfolders that a reader recognises (verl's ``actor``, ``critic``)."""
    return [d.name for d in _subfolders(folder) if any(reader(name).detect(d) for name in READERS)]


def open_checkpoint(
    role_dir: str | Path, options: MergeOptions, config: CheckpointConfig | None = None, *, merged: bool = False
) -> CheckpointPlan:
    """Discover and validate one role folder (``global_step_N/actor``); every problem is a ``MergeError``.

    ``config``: the checkpoint's model config, resolved once for the whole merge (``pipeline.prepare``).
    ``merged``: an HF model folder (a merge's output) is taken too, as averaging takes its inputs.
    """
    role_dir = Path(role_dir).absolute()
    if not role_dir.is_dir():
        raise MergeError(role_dir, "not a directory" if role_dir.exists() else "does not exist")
    if merged and is_hf_model_folder(role_dir):
        plan = reader("hf").plan_model_folder(role_dir)
    else:
        backend = detect_backend(role_dir) if options.backend == "auto" else options.backend
        plan = reader(backend).plan(role_dir, options, config or CheckpointConfig.of(role_dir, options))
    # Weights follow the side files' rule: no link out of the checkpoint. The base model folder
    # (--hf_model_path, where a LoRA-only checkpoint's base weights come from) is the user's own choice.
    base = Path(options.hf_model_path).absolute() if options.hf_model_path else None
    with closed_on_failure(plan.files):
        for f in plan.files:
            if base is None or not f.path.absolute().is_relative_to(base):
                f.source.require_inside(role_dir)
    return plan
