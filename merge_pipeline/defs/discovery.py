"""Find trainer checkpoints on disk and decide when one is complete. Plain filesystem work.

The step folders of each stack (``partitions.STEP_FOLDERS``): verl's ``global_step_<N>/<role>/``
(the SFT trainer saves its model rank files straight into ``global_step_<N>/``), a DeepSpeed tag
``global_step<N>/`` (beside ``latest`` in its save dir), torchtitan's ``step-<N>/`` (a DCP folder), the
HF Trainer's ``checkpoint-<N>/`` (accelerate's ``pytorch_model_fsdp_0/``, or a DeepSpeed save dir) and
NeMo-RL's ``step_<N>/policy/``. verl writes ``latest_checkpointed_iteration.txt`` beside its steps
last, after every role of step N is saved. Folders may vanish at any moment (the trainer's rotation
deletes old steps): every listing and stat here tolerates that.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from merge_pipeline.defs.partitions import (
    DEEPSPEED,
    HF_TRAINER,
    STEP_FOLDERS,
    STEP_ROLE,
    VERL,
    CheckpointKey,
    StepFolder,
    step_folder,
)
from merge_pipeline.errors import MergeError, printable
from merge_pipeline.input_files import read_capped
from merge_pipeline.pipeline import (
    ACCELERATE_DCP_DIR,
    DEEPSPEED_LATEST,
    FSDP_RANK_FILE,
    find_dcp_dir,
    is_deepspeed_tag_name,
    missing_optimizer_states,
    read_deepspeed_latest,
)

TRACKER = "latest_checkpointed_iteration.txt"
MEGATRON_MANIFEST = "ckpt_contents.json"  # verl's Megatron layout v2: rank 0 writes it last, atomically
_MEGATRON_V2_FOLDERS = ("model/dist_ckpt", "model/huggingface", "optimizer/dist_ckpt", "extra/dist_ckpt")
MAX_TRACKER_BYTES = 64  # a step number; verl writes a few bytes: a larger file is not a tracker
MAX_DEPTH = 3  # a step folder sits at most this many levels below a watched root
_DCP_DONE = ".metadata present (dcp.save's coordinator writes it after every rank's data)"


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
    """Every checkpoint in a step folder (``STEP_FOLDERS``) at most three levels below ``root``.

    The run name is the trainer folder's path relative to ``root``, or ``root``'s own name when the
    steps sit directly in it. Hidden folders, step folders and the folders in ``skip`` are not
    entered. Why a folder could not be watched (the root missing or unreadable, a step folder whose
    name would not lead back to it) is appended to ``not_watched``.
    """
    root = root.absolute()
    level = [root]
    for _ in range(MAX_DEPTH):
        deeper = []
        for folder in level:
            for entry in _subfolders(folder, not_watched, root=root):
                if entry.name.startswith(".") or entry in skip:
                    continue
                found = step_folder(entry.name)
                if found is None:
                    odd = next((f for f in STEP_FOLDERS if f.look_alike.fullmatch(entry.name)), None)
                    if odd:
                        not_watched.append(
                            f"{printable(str(entry))}: skipped: {odd.stack} names step folders {odd.prefix}<N> with ASCII digits and no leading zeros, and only such a name maps to a partition and back"
                        )
                    else:
                        deeper.append(entry)
                    continue
                stack, step = found
                run_name = root.name if folder == root else folder.relative_to(root).as_posix()
                roles = [role for role in stack.roles if (entry / role).is_dir() and _inside(entry / role, root)]
                if stack.in_step_folder and not roles and _saved_in_step_folder(stack, entry):
                    yield FoundCheckpoint(CheckpointKey(run_name, step, STEP_ROLE, stack.prefix), entry)
                for role in roles:
                    yield FoundCheckpoint(CheckpointKey(run_name, step, role, stack.prefix), entry / role)
        level = deeper


def _saved_in_step_folder(stack: StepFolder, step_dir: Path) -> bool:
    """Whether the step folder itself is a checkpoint of ``stack`` (what it holds may still be partial)."""
    if stack is VERL:
        return _holds_model_files(step_dir)
    if stack is DEEPSPEED:
        return (step_dir.parent / DEEPSPEED_LATEST).is_file()
    if stack is HF_TRAINER:
        return (step_dir / ACCELERATE_DCP_DIR).is_dir() or (step_dir / DEEPSPEED_LATEST).is_file()
    return True  # torchtitan: the step folder is the DCP folder


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
    """Whether a checkpoint folder is completely saved, by its stack's rule (the reason says which).

    verl: its Megatron manifest is there, or the tracker beside ``global_step_<N>`` says >= N.
    DeepSpeed: ``latest`` names this tag (or a later one) and every rank's optimizer states are there.
    DCP (torchtitan, accelerate, NeMo-RL): ``.metadata`` is there and the settle time passed. Else
    nothing under the folder changed for the settle time. The DCP and DeepSpeed tests are the
    readers' own (through ``pipeline``): a folder they pass is one the reader's detection recognises.
    """
    newest = newest_change(role_dir)
    if newest is None:
        return Completeness(False, "no files yet", None)
    age = (time.time() if now is None else now) - newest
    stack = _stack_of(role_dir)
    if stack is VERL:
        return _verl_completeness(role_dir, step, settle_seconds, newest, age)
    if stack is DEEPSPEED:
        return _deepspeed_completeness(role_dir.parent, role_dir.name, step, settle_seconds, newest, age)
    if (role_dir / DEEPSPEED_LATEST).is_file():  # the HF Trainer's checkpoint-<N>/ as a DeepSpeed save dir
        tag = _read_latest(role_dir) or ""
        return _deepspeed_completeness(role_dir, tag, None, settle_seconds, newest, age)
    return _dcp_completeness(role_dir, settle_seconds, newest, age)


def _stack_of(role_dir: Path) -> StepFolder:
    """The stack whose step folder ``role_dir`` is, or holds it; verl's for any other folder."""
    for folder in (role_dir, role_dir.parent):
        if found := step_folder(folder.name):
            return found[0]
    return VERL


def _verl_completeness(role_dir: Path, step: int, settle_seconds: float, newest: float, age: float) -> Completeness:
    if (role_dir / MEGATRON_MANIFEST).is_file():
        return Completeness(True, f"{MEGATRON_MANIFEST} present (verl writes it last)", newest)
    step_dir = role_dir if VERL.name.fullmatch(role_dir.name) else role_dir.parent
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
    return _settled(f"{TRACKER} says {latest}" if latest is not None else f"no {TRACKER}", settle_seconds, newest, age)


def _deepspeed_completeness(
    save_dir: Path, tag: str, step: int | None, settle_seconds: float, newest: float, age: float
) -> Completeness:
    """``step``: the tag folder's step, for a tag that ``latest`` may have passed already."""
    named = _read_latest(save_dir)
    named_step = step_folder(named) if named else None
    passed = step is not None and named_step is not None and named_step[0] is DEEPSPEED and named_step[1] > step
    if not named or (named != tag and not passed):
        return Completeness(
            False,
            f"DeepSpeed: {DEEPSPEED_LATEST} names {named or 'nothing'}, not {tag} yet (DeepSpeed writes it after every rank's files)",
            newest,
        )
    if not is_deepspeed_tag_name(tag) or not (save_dir / tag).is_dir():  # a hostile `latest` leads nowhere else
        return Completeness(
            False, f"DeepSpeed: {DEEPSPEED_LATEST} names {tag!r}, which is no tag folder beside it", newest
        )
    says = f"DeepSpeed: {DEEPSPEED_LATEST} names {'this tag' if named == tag else f'the later tag {named}'}"
    missing = missing_optimizer_states(save_dir / tag)
    if missing is None:
        return _settled(f"{says}; the model states do not say the dp world size", settle_seconds, newest, age)
    if missing:
        return Completeness(False, f"{says}, but {len(missing)} rank file(s) missing: {', '.join(missing[:3])}", newest)
    return Completeness(True, f"{says} and every rank's *_optim_states.pt is there", newest)


def _dcp_completeness(role_dir: Path, settle_seconds: float, newest: float, age: float) -> Completeness:
    if find_dcp_dir(role_dir) is None:
        return Completeness(
            False, "DCP: no .metadata yet (dcp.save's coordinator writes it after every rank's data)", newest
        )
    return _settled(f"DCP: {_DCP_DONE}", settle_seconds, newest, age)


def _settled(says: str, settle_seconds: float, newest: float, age: float) -> Completeness:
    if age >= settle_seconds:
        return Completeness(True, f"{says}; no file changed for {age:.0f} s (settle time {settle_seconds:g} s)", newest)
    return Completeness(False, f"{says}; a file changed {age:.0f} s ago (settle time {settle_seconds:g} s)", newest)


def _read_latest(save_dir: Path) -> str | None:
    """What ``latest`` names; None when there is none, or it is no small regular file (a FIFO never blocks the tick)."""
    try:
        return read_deepspeed_latest(save_dir / DEEPSPEED_LATEST) or None
    except (MergeError, OSError):
        return None


def read_tracker(path: Path) -> int | None:
    try:
        return int(read_capped(path, MAX_TRACKER_BYTES, "too large to be a step number").strip())
    except (MergeError, OSError, ValueError):
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


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path``, symlinks resolved, stays inside the watched ``root``: a link out of it (into
    someone's private folder) is never followed."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))


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
