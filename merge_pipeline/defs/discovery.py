"""Find trainer checkpoints on disk and decide when one is complete. Plain filesystem work.

A trainer root holds ``global_step_<N>/<role>/`` folders and ``latest_checkpointed_iteration.txt``,
which verl writes last, after every role of step N is saved. The SFT trainer saves its model rank
files straight into ``global_step_<N>/`` (no role folder); that step folder is then the checkpoint.
Folders may vanish at any moment (the trainer's rotation deletes old steps): every listing and stat
here tolerates that.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from merge_pipeline.defs.partitions import ROLES, STEP_DIR, STEP_ROLE, CheckpointKey
from merge_pipeline.errors import MergeError, printable
from merge_pipeline.pipeline import FSDP_RANK_FILE

TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_MANIFEST = "ckpt_contents.json"  # verl's Megatron layout v2: rank 0 writes it last, atomically
_MEGATRON_V2_FOLDERS = ("model/dist_ckpt", "model/huggingface", "optimizer/dist_ckpt", "extra/dist_ckpt")
_LOOKS_LIKE_STEP = re.compile(r"global_step_\d+")  # \d: any Unicode digit, as int() reads them
MAX_DEPTH = 3  # a global_step_<N> folder sits at most this many levels below a watched root


@dataclass(frozen=True)
class FoundCheckpoint:
    key: CheckpointKey
    role_dir: Path


@dataclass(frozen=True)
class Completeness:
    complete: bool
    reason: str  # one line a person reads in the UI
    newest_change: float | None  # newest mtime under the role folder; None when it holds no file


@dataclass
class Scan:
    """What a look over the watched roots found, and what it could not watch (one line each, why)."""

    found: list[FoundCheckpoint] = field(default_factory=list)
    not_watched: list[str] = field(default_factory=list)
    all_roots_read: bool = True  # False: a root was missing or unreadable, so an absent folder proves nothing


def scan_roots(roots: Sequence[Path], output_root: Path) -> Scan:
    """Every role folder under every root; the output root is never mistaken for a checkpoint."""
    scan = Scan()
    output_root = output_root.absolute()
    for root in roots:
        root = root.absolute()
        if output_root.is_relative_to(root):
            scan.not_watched.append(
                f"{printable(str(output_root))}: the output root lies inside the checkpoint root {printable(str(root))} (not scanned; better kept apart)"
            )
        if not (root.is_dir() and os.access(root, os.R_OK | os.X_OK)):
            scan.all_roots_read = False
        scan.found.extend(find_checkpoints(root, scan.not_watched, skip={output_root}))
    return scan


def find_checkpoints(root: Path, not_watched: list[str], *, skip: Collection[Path] = ()) -> Iterator[FoundCheckpoint]:
    """Every ``global_step_<N>/<role>`` folder (or SFT ``global_step_<N>``) at most three levels below ``root``.

    The run name is the trainer folder's path relative to ``root``, or ``root``'s own name when the
    steps sit directly in it. Hidden folders and the folders in ``skip`` are not entered. Why a
    folder could not be watched (the root missing or unreadable, a step folder whose name would
    not lead back to it) is appended to ``not_watched``.
    """
    root = root.absolute()
    level = [root]
    for _ in range(MAX_DEPTH):
        deeper = []
        for folder in level:
            for entry in _subfolders(folder, not_watched, is_root=folder == root):
                if entry.name.startswith(".") or entry in skip:
                    continue
                step = STEP_DIR.fullmatch(entry.name)
                if not step:
                    if _LOOKS_LIKE_STEP.fullmatch(entry.name):
                        not_watched.append(
                            f"{printable(str(entry))}: skipped: verl names step folders global_step_<N> with ASCII digits and no leading zeros, and only such a name maps to a partition and back"
                        )
                    else:
                        deeper.append(entry)
                    continue
                run_name = root.name if folder == root else folder.relative_to(root).as_posix()
                roles = [role for role in ROLES if (entry / role).is_dir()]
                if not roles and _holds_model_files(entry):
                    yield FoundCheckpoint(CheckpointKey(run_name, int(step.group(1)), STEP_ROLE), entry)
                for role in roles:
                    yield FoundCheckpoint(CheckpointKey(run_name, int(step.group(1)), role), entry / role)
        level = deeper


def locate(key: CheckpointKey, roots: Sequence[Path]) -> Path:
    """The role folder a partition key names: the inverse of ``find_checkpoints``, over all roots."""
    candidates = [root / key.path for root in roots]
    candidates += [root / key.path.relative_to(key.run_name) for root in roots if root.name == key.run_name]
    found = sorted({c for c in candidates if c.is_dir()})
    if not found:
        raise MergeError(
            candidates[0] if candidates else None,
            "no such checkpoint folder under the checkpoint roots (deleted by the trainer's rotation?)",
        )
    if len(found) > 1:
        raise MergeError(
            found[1], f"has the same partition key as {found[0]}: give the checkpoint roots distinct run folders"
        )
    return found[0]


def completeness(role_dir: Path, step: int, settle_seconds: float, *, now: float | None = None) -> Completeness:
    """Complete when verl's Megatron manifest is there, when the tracker beside ``global_step_<N>``
    says >= N, or when nothing under the role folder changed for the settle time."""
    newest = newest_change(role_dir)
    if newest is None:
        return Completeness(False, "no files yet", None)
    if (role_dir / MEGATRON_MANIFEST).is_file():
        return Completeness(True, f"{MEGATRON_MANIFEST} present (verl writes it last)", newest)
    step_dir = role_dir if STEP_DIR.fullmatch(role_dir.name) else role_dir.parent
    latest = read_tracker(step_dir.parent / TRACKER)
    if latest is not None and latest >= step:
        return Completeness(True, f"{TRACKER} says {latest} >= {step}", newest)
    if any((role_dir / folder).is_dir() for folder in _MEGATRON_V2_FOLDERS):
        # A quiet folder proves nothing here: the bridge may gather weights for minutes before writing.
        return Completeness(
            False,
            f"Megatron layout v2 without {MEGATRON_MANIFEST}: verl writes it last, the save is not finished",
            newest,
        )
    age = (time.time() if now is None else now) - newest
    says = f"{TRACKER} says {latest}" if latest is not None else f"no {TRACKER}"
    if age >= settle_seconds:
        return Completeness(True, f"{says}; no file changed for {age:.0f} s (settle time {settle_seconds:g} s)", newest)
    return Completeness(False, f"{says}; a file changed {age:.0f} s ago (settle time {settle_seconds:g} s)", newest)


def read_tracker(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def newest_change(folder: Path) -> float | None:
    """The newest mtime of any file or folder below ``folder`` (None when it holds no file)."""
    newest, files = None, 0
    for parent, dirs, names in os.walk(folder):
        for name in dirs + names:
            try:
                mtime = os.stat(os.path.join(parent, name)).st_mtime
            except OSError:
                continue
            newest = mtime if newest is None else max(newest, mtime)
        files += len(names)
    return newest if files else None


def _holds_model_files(folder: Path) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(FSDP_RANK_FILE.match(e.name) for e in entries)
    except OSError:  # deleted meanwhile
        return False


def _subfolders(folder: Path, not_watched: list[str], *, is_root: bool) -> list[Path]:
    try:
        with os.scandir(folder) as entries:
            return sorted(Path(e.path) for e in entries if _is_dir(e))
    except FileNotFoundError:  # a step folder the trainer's rotation just deleted: nothing to watch
        if is_root:
            not_watched.append(f"{printable(str(folder))}: the checkpoint root does not exist")
        return []
    except OSError as exc:  # unreadable, not a folder, a symlink loop: say so, never "no new checkpoints"
        not_watched.append(
            f"{printable(str(folder))}: {'the checkpoint root' if is_root else 'folder'} cannot be read ({exc.strerror})"
        )
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False
