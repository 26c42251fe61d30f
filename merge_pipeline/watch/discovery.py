"""Find trainer checkpoints on disk under the watched roots. Plain filesystem work.

Which folders are step folders, whether one holds a save itself, and when a save is complete are
the readers' answers (``pipeline.step_folders``, ``saved_in_step_folder``, ``completeness``): verl's
``global_step_<N>/<role>/``, a DeepSpeed tag ``global_step<N>/``, torchtitan's ``step-<N>/``, the HF
Trainer's ``checkpoint-<N>/``, NeMo-RL's ``step_<N>/policy/``, Megatron-LM's ``iter_0000100/``. Folders
may vanish at any moment (the trainer's rotation deletes old steps): every listing and stat here
tolerates that.

A root in a store (``s3://bucket/prefix``) is looked over the same way, through listings laid out
locally (``store.listing.Mirror``): each folder above the step folders and each step folder's own
entries, one page of keys at a time, never the rank files of steps already known; a new step's
completeness lists its objects whole with the trackers beside it and asks the readers (markers, then
the objects' ``LastModified`` for the settle time). Such steps are never pinned: objects are immutable,
and one deleted or re-uploaded while it is merged fails that merge's next read in one line (its ranged
GETs are pinned to the ETags listed).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from merge_pipeline.checkpoint_name import STEP_ROLE, CheckpointName
from merge_pipeline.errors import MergeError, printable
from merge_pipeline.formats import completeness as readers_completeness
from merge_pipeline.formats import saved_in_step_folder, step_folder, step_folders, weight_suffixes
from merge_pipeline.formats.step_folders import Completeness as Completeness  # the sensor's and the asset's answer type
from merge_pipeline.formats.step_folders import newest_change as newest_change  # a pinned step's age
from merge_pipeline.store.listing import Folder, Mirror, StoreURL, in_store, laid_out, on_disk, refusal
from merge_pipeline.store.target_rules import within

MAX_DEPTH = 3  # a step folder sits at most this many levels below a watched root


@dataclass(frozen=True)
class FoundCheckpoint:
    key: CheckpointName
    role_dir: Folder


@dataclass
class Scan:
    """What a look over the watched roots found, and what it could not watch (one line each, why)."""

    found: list[FoundCheckpoint] = field(default_factory=list)
    not_watched: list[str] = field(default_factory=list)
    all_roots_read: bool = True  # False: a root was missing or unreadable, so an absent folder proves nothing


def scan_roots(roots: Sequence[Folder], output_root: Folder) -> Scan:
    """Every role folder under every root; the output root is never mistaken for a checkpoint, however
    either is spelled (compared with symlinks and ``..`` resolved). Roots in a store: ``scan_store_root``."""
    scan = Scan()
    for store_root in filter(None, map(in_store, roots)):
        scan_store_root(store_root, output_root, scan)
    local = on_disk(output_root)  # a store lies in no folder
    local = local and local.absolute()
    skip = {output} if local and (output := _identity(local)) else set()
    for root in filter(None, map(on_disk, roots)):
        root = root.absolute()
        if local and not _watched_beside(local, root, scan):
            continue
        if not (root.is_dir() and os.access(root, os.R_OK | os.X_OK)):
            scan.all_roots_read = False
        scan.found.extend(find_checkpoints(root, scan.not_watched, skip=skip))
    return scan


def find_checkpoints(
    root: Path, not_watched: list[str], *, skip: Collection[tuple[int, int]] = ()
) -> Iterator[FoundCheckpoint]:
    """Every checkpoint in a step folder (``step_folders()``) at most three levels below ``root``.

    The run name is the trainer folder's path relative to ``root``, or ``root``'s own name when the
    steps sit directly in it. Hidden folders, step folders and the folders in ``skip`` (their
    ``_identity``: the same folder however its path is spelled) are not entered. Why a folder could not be watched (the
    root missing or unreadable, a step folder whose name would not lead back to it) is appended to
    ``not_watched``.
    """
    root = root.absolute()
    level = [root]
    for _ in range(MAX_DEPTH):
        deeper = []
        for folder in level:
            for entry in _subfolders(folder, not_watched, root=root):
                if entry.name.startswith(".") or (skip and _identity(entry) in skip):
                    continue
                found = step_folder(entry.name)
                if found is None:
                    odd = next((f for f in step_folders() if f.look_alike.fullmatch(entry.name)), None)
                    if odd:
                        not_watched.append(
                            f"{printable(str(entry))}: skipped: {odd.stack} names step folders {odd.prefix}<N> {odd.numbering}, and only such a name maps to a partition and back"
                        )
                    else:
                        deeper.append(entry)
                    continue
                stack, step = found
                run_name = root.name if folder == root else folder.relative_to(root).as_posix()
                roles = [role for role in stack.roles if (entry / role).is_dir() and _inside(entry / role, root)]
                if stack.in_step_folder and not roles and saved_in_step_folder(entry, stack):
                    yield FoundCheckpoint(CheckpointName(STEP_ROLE, run_name, entry.name, step, stack.stack), entry)
                for role in roles:
                    yield FoundCheckpoint(CheckpointName(role, run_name, entry.name, step, stack.stack), entry / role)
        level = deeper


def locate(key: CheckpointName, roots: Sequence[Folder]) -> Folder:
    """The role folder a partition key names: the inverse of ``find_checkpoints``, over all roots (a
    store root's ``StoreURL`` is asked as a folder is)."""
    candidates = [root / key.path for root in roots]
    candidates += [root / key.path.relative_to(key.run) for root in roots if root.name == key.run]
    found = sorted({c for c in candidates if c.is_dir()}, key=str)
    if not found:
        raise refusal(
            candidates[0] if candidates else None,
            "no such checkpoint folder under the checkpoint roots (deleted by the trainer's rotation?)",
        )
    if len(found) > 1:
        raise refusal(
            found[1], f"has the same partition key as {found[0]}: give the checkpoint roots distinct run folders"
        )
    return found[0]


def completeness(folder: Folder, step: int, settle_seconds: float) -> Completeness:
    """The readers' answer (``pipeline.completeness``); for a folder in a store, asked of its listing."""
    with laid_out(folder, weight_suffixes()) as local:
        return readers_completeness(local, step, settle_seconds)


# --- checkpoint roots in a store (``s3://bucket/prefix``) -------------------------------------------------


def scan_store_root(root: StoreURL, output_root: Folder, scan: Scan) -> None:
    """Every checkpoint under ``root`` into ``scan.found`` (as URLs), or why the root cannot be watched."""
    output = in_store(output_root)
    if output is not None and not _watched_beside(output, root, scan):
        return
    inside = output is not None and within(output, root)
    try:
        with Mirror(weight_suffixes()) as mirror:
            local_root = mirror.folder(root)
            if not _listed(mirror, root, skip=output if inside else None):
                scan.not_watched.append(f"{printable(root)}: no object under the checkpoint root")
                scan.all_roots_read = False
                return
            skip = {ident} if inside and (ident := _identity(mirror.folder(output))) else set()
            notes: list[str] = []
            for found in find_checkpoints(local_root, notes, skip=skip):
                scan.found.append(FoundCheckpoint(found.key, root / found.role_dir.relative_to(local_root)))
            scan.not_watched += [note.replace(str(local_root), root) for note in notes]
    except MergeError as exc:  # wrong credentials, no such bucket: the store's words, never a secret
        scan.not_watched.append(str(exc))
        scan.all_roots_read = False


def _watched_beside(output: Folder, root: Folder, scan: Scan) -> bool:
    """Whether ``root`` is scanned, given the output root (compared as the target rules compare, folders
    resolved, URLs normalised): said when the output lies inside it (then skipped in the scan) or is it
    (then nothing is scanned: every merge would write into its own input)."""
    if not within(output, root):
        return True
    if within(root, output):
        scan.not_watched.append(
            f"{printable(str(output))}: the output root is the checkpoint root {printable(str(root))} (not scanned: each merge would write into its input; keep them apart)"
        )
        scan.all_roots_read = False
        return False
    scan.not_watched.append(
        f"{printable(str(output))}: the output root lies inside the checkpoint root {printable(str(root))} (not scanned; better kept apart)"
    )
    return True


def _listed(mirror: Mirror, root: StoreURL, *, skip: StoreURL | None) -> bool:
    """The folders down to the step folders (``MAX_DEPTH`` levels, as ``find_checkpoints`` walks them) and
    each step folder's own entries, laid out in ``mirror``; whether ``root`` holds anything."""
    level, anything = [root], False
    for _ in range(MAX_DEPTH):
        deeper = []
        for url in level:
            for name in mirror.list(url):
                anything = True
                if name.startswith(".") or url / name == skip:
                    continue
                if step_folder(name):
                    mirror.list(url / name)
                else:
                    deeper.append(url / name)
        level = deeper
    return anything or any(mirror.folder(root).iterdir())


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path``, symlinks resolved, stays inside the watched ``root``: a link out of it (into
    someone's private folder) is never followed."""
    return _resolved(path).is_relative_to(_resolved(root))


def _identity(path: Path) -> tuple[int, int] | None:
    """A folder's (device, inode), links followed: one stat, where resolving the path costs one per component."""
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _resolved(path: Path | str) -> Path:
    """``path`` with symlinks and ``..`` resolved (a symlink loop left as it is: its listing says why)."""
    return Path(os.path.realpath(path))


def _subfolders(folder: Path, not_watched: list[str], *, root: Path) -> list[Path]:
    is_root = folder == root
    try:
        with os.scandir(folder) as entries:
            return sorted(Path(e.path) for e in entries if _is_dir(e) and (not e.is_symlink() or _inside(e.path, root)))
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
