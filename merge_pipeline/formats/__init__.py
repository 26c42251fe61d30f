"""Format readers: each turns a role folder into a ``CheckpointPlan`` without loading tensor data.

A reader is a module of this package, named by its backend, exposing ``READER``: an object with a
``name``, ``detect(folder)`` and ``plan(folder, options)`` (the ``Reader`` protocol). Adding a
format means adding its module and its name to ``READERS``; nothing else here changes.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Protocol

from merge_pipeline.errors import MergeError
from merge_pipeline.input_files import require_opened_inside
from merge_pipeline.options import BACKENDS, MergeOptions
from merge_pipeline.plan import CheckpointPlan, closed_on_failure

# Reader modules, in the order ``auto`` tries them: the first whose detect() says yes plans the folder.
# Their names are the --backend choices (options.BACKENDS, which the CLI and Dagster offer).
READERS = BACKENDS[1:]
STEP_FOLDER = re.compile(r"global_step_?(\d+)")  # verl's global_step_N, DeepSpeed's global_stepN


class Reader(Protocol):
    name: str  # the --backend value, and the module's name
    looks_for: str  # what detect() looks for, for the error when no reader recognises a folder

    def detect(self, role_dir: Path) -> bool: ...

    def plan(self, role_dir: Path, options: MergeOptions) -> CheckpointPlan: ...


def reader(name: str) -> Reader:
    """The reader of ``--backend name``; imported only when asked for (Megatron's pulls in megatron-core types)."""
    if name not in READERS:
        raise MergeError(None, f"--backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    return importlib.import_module(f"{__name__}.{name}").READER


def detect_backend(role_dir: Path) -> str:
    for name in READERS:
        if reader(name).detect(role_dir):
            return name
    problem = misplaced_folder(role_dir) or "neither " + " nor ".join(reader(name).looks_for for name in READERS)
    raise MergeError(role_dir, problem)


def misplaced_folder(folder: Path) -> str | None:
    """What ``folder`` is when it is one of the common wrong answers to "which folder?", and what to
    pass instead: a step holding role folders, a trainer's run folder, or an already merged HF folder."""
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return "is already a merged Hugging Face folder (config.json, *.safetensors): nothing to merge"
    roles = _checkpoints_in(folder)
    if roles:
        return f"holds role folders {', '.join(roles)}: pass {folder / roles[0]}"
    steps = {int(m[1]): m[0] for d in _subfolders(folder) if (m := STEP_FOLDER.fullmatch(d.name))}
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


def open_checkpoint(role_dir: str | Path, options: MergeOptions) -> CheckpointPlan:
    """Discover and validate one role folder (``global_step_N/actor``); every problem is a ``MergeError``."""
    role_dir = Path(role_dir).absolute()
    if not role_dir.is_dir():
        raise MergeError(role_dir, "not a directory" if role_dir.exists() else "does not exist")
    backend = detect_backend(role_dir) if options.backend == "auto" else options.backend
    plan = reader(backend).plan(role_dir, options)
    # Weights follow the side files' rule: no link out of the checkpoint. The base model folder
    # (--hf_model_path, where a LoRA-only checkpoint's base weights come from) is the user's own choice.
    base = Path(options.hf_model_path).absolute() if options.hf_model_path else None
    with closed_on_failure(plan.files):
        for f in plan.files:
            if base is None or not f.path.absolute().is_relative_to(base):
                with f.opened() as fd:
                    require_opened_inside(fd, f.path, role_dir)
    return plan
