"""Keep a complete step alive until its merge is done (``pin_steps``, off by default).

A trainer's rotation (verl's ``max_ckpt_to_keep``) may delete a complete step while its merge waits
in the queue. With pinning on, the sensor hard-links every file of the checkpoint folder into its
pin the moment it requests the merge; the merge reads that pinned copy and removes it once the step
is published or failed. A hard link costs no bytes and outlives the trainer's delete of the
original. Hard links cannot cross filesystems: there the step is not pinned (a warning, never a copy
of the bytes). The pin root is ``<checkpoint root>/.merge_pins`` (hidden, so the sensor's scan never
enters it), or the ``pin_root`` setting.

Pins belong to the deployment that made them (``PinSpace``): ``<pin root>/out-<digest of its output
root>/<key, quoted>/<step folder>/<role>``, so a bf16 and an fp8 deployment watching one root each
keep their own until their own merge is done, and each one's stale sweep sees only its own.

The checkpoint root may be shared with other users (``docs/SAFETY.md``, "Data is never lost"):
every folder from the pin root down is ours, made with mode 0700 and opened without following a
link (``files.shared_folders``), so a pin never lets another user read a file, and an entry planted there
is refused in one line and left alone. A pin is read only if it still holds the very files (device,
inode, size, mtime) its record lists from when it was made; else the merge reads the step itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import dagster as dg

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.errors import MergeError, printable
from merge_pipeline.files.shared_folders import open_own_folder, refuse_planted, refuse_planted_fd
from merge_pipeline.watch.partitions import checkpoint_key

log = logging.getLogger("merge_pipeline")

RECORD = ".pin_record.json"  # in the key folder, beside the step folder; no step folder is named so
MAX_RECORD_BYTES = 64 * 10**6  # ~100 bytes per file: far above any step
PARTITION_TAG = "dagster/partition"
PIN_GRACE_SECONDS = 120  # a run requested by a tick exists by the next one; this much more is for a busy daemon
ACTIVE_RUNS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]

# A pinned file is the file pinned while these are: (dev, ino) is the inode, size and mtime its bytes.
# Not ctime: linking and unlinking change it, so the trainer's delete of the original (what a pin is
# for) and another deployment's pin of the same step would make every pin look swapped.
Identity = tuple[int, int, int, int]


@dataclass(frozen=True)
class PinSpace:
    """The pins of one deployment: the folder ``owner`` (a digest of its output root) in ``root``."""

    root: Path
    owner: str

    @classmethod
    def of(cls, root: Path, output_root: Path) -> PinSpace:
        return cls(root, f"out-{hashlib.sha256(os.fsencode(output_root)).hexdigest()[:16]}")

    @property
    def folder(self) -> Path:
        return self.root / self.owner


def pin_path(space: PinSpace, key: CheckpointName) -> Path:
    """Where ``key``'s pin lies: ``<space>/<key, quoted>/<step folder>[/<role>]``: one folder per key
    (found again by listing the space), ending in the step folder's and role's own names as the readers
    and the model card see them."""
    return _key_folder(space, key) / _inside(key)


def pin(role_dir: Path, space: PinSpace, key: CheckpointName) -> str | None:
    """Hard-link the files of ``role_dir`` into its pin and record them; None when pinned (or already
    pinned with these very files), else the one-line reason why not."""
    folder = _key_folder(space, key)
    try:
        with _opened_space(space, create=True, same_device_as=role_dir) as owner:
            if refuse_planted(folder, stat.S_IFDIR, dir_fd=owner) is not None:  # an earlier pin of ours
                with contextlib.suppress(MergeError):
                    if _verified_files(owner, folder, key) == _identities(role_dir, _inside(key)):
                        return None
                shutil.rmtree(folder.name, dir_fd=owner)  # another save of this step, or a pin cut short
            key_fd = open_own_folder(owner, folder, create=True, private=True)
            try:
                _write_record(key_fd, folder, key, _link_tree(role_dir, key_fd, folder, _inside(key)))
            finally:
                os.close(key_fd)
    except _OtherFilesystem:
        return f"{printable(str(role_dir))}: not pinned: the pin folder {printable(str(space.root))} is on another filesystem (hard links cannot cross filesystems; the step is merged from where it is, if the trainer keeps it)"
    except MergeError as refused:  # an entry planted by another user: refused, left alone
        return f"{printable(str(role_dir))}: not pinned: {refused}"
    except OSError as exc:  # the trainer deleting the step under us, a full inode table, no permission
        unpin(space, key)
        return f"{printable(str(role_dir))}: not pinned: {exc.strerror or exc}"
    return None


def verified_pin(space: PinSpace, key: CheckpointName) -> Path | None:
    """``key``'s pinned folder, if ours and still holding the very files recorded when it was made;
    else None, and a warning saying why when something was there (the step is then read where it is)."""
    folder = _key_folder(space, key)
    try:
        with _opened_space(space, create=False) as owner:
            if refuse_planted(folder, stat.S_IFDIR, dir_fd=owner) is None:
                return None
            _verified_files(owner, folder, key)
    except FileNotFoundError:  # no pin root or no space of ours: nothing pinned
        return None
    except (MergeError, OSError) as exc:
        log.warning("%s: its pin is not read (%s); the step is read where the trainer saved it", key, exc)
        return None
    return pin_path(space, key)


def unpin(space: PinSpace, key: CheckpointName) -> None:
    """Remove a pin of ours: its links only (the trainer's files, where still there, are other links to
    the same data). Nothing that is not ours is removed, nor anything through a link."""
    folder = _key_folder(space, key)
    with contextlib.suppress(OSError, MergeError), _opened_space(space, create=False) as owner:
        if refuse_planted(folder, stat.S_IFDIR, dir_fd=owner) is not None:
            shutil.rmtree(folder.name, ignore_errors=True, dir_fd=owner)


def stale_pins(
    instance: dg.DagsterInstance, spaces: list[PinSpace], keep: set[str]
) -> list[tuple[PinSpace, CheckpointName]]:
    """This deployment's pins no run will read: no run of their partition is queued or running, and they
    are not new.

    The merge removes its pin itself; this finds what a run that never reached its merge step left
    (cancelled in the queue, its worker killed before the step, deleted by hand)."""
    stale = []
    for space in spaces:
        for key, made in _pins_in(space):
            if str(key) in keep or time.time() - made < PIN_GRACE_SECONDS:
                continue
            active = instance.get_runs(dg.RunsFilter(tags={PARTITION_TAG: str(key)}, statuses=ACTIVE_RUNS), limit=1)
            if not active:
                stale.append((space, key))
    return stale


def _pins_in(space: PinSpace) -> list[tuple[CheckpointName, float]]:
    """The key and last change (mtime) of each pin in ``space``; none where the space is not ours, or
    cannot be read (an unreadable checkpoint root is the scan's warning)."""
    found = []
    with contextlib.suppress(OSError, MergeError), _opened_space(space, create=False) as owner:
        for name in os.listdir(owner):
            try:
                key = checkpoint_key(unquote(name))
                found.append((key, os.stat(name, dir_fd=owner, follow_symlinks=False).st_mtime))
            except (MergeError, FileNotFoundError):  # not a key's name; removed by its merge since the listing
                continue
    return found


def _key_folder(space: PinSpace, key: CheckpointName) -> Path:
    return space.folder / quote(str(key), safe="")


def _inside(key: CheckpointName) -> Path:
    """The step folder (and role) below the key folder."""
    return key.path.relative_to(key.run)


class _OtherFilesystem(Exception):
    pass


@contextlib.contextmanager
def _opened_space(space: PinSpace, *, create: bool, same_device_as: Path | None = None) -> Iterator[int]:
    """A descriptor of the space's folder: the pin root and it opened (with ``create``, made) without
    following a link, both ours, the space 0700. The pin root's own parent is the user's choice of
    place and may be reached through links. ``same_device_as``: _OtherFilesystem before the space is made."""
    with contextlib.ExitStack() as opened:
        if create:
            space.root.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(space.root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        opened.callback(os.close, parent)
        root = open_own_folder(parent, space.root, create=create, private=False)
        opened.callback(os.close, root)
        if same_device_as is not None and os.fstat(root).st_dev != os.stat(same_device_as).st_dev:
            raise _OtherFilesystem
        owner = open_own_folder(root, space.folder, create=create, private=True)
        opened.callback(os.close, owner)
        yield owner


def _identities(role_dir: Path, inside: Path) -> dict[str, Identity]:
    """What a pin of ``role_dir`` made now would record: each file's identity, by its path in the pin."""
    with _walked(role_dir) as walk:
        return {
            str(inside / relative / name): _identity(os.stat(name, dir_fd=folder_fd, follow_symlinks=False))
            for relative, files, folder_fd in walk
            for name in files
        }


@contextlib.contextmanager
def _walked(role_dir: Path) -> Iterator[Iterator[tuple[Path, list[str], int]]]:
    """(folder relative to ``role_dir``, its files, its descriptor), top down, entering no symlink below
    ``role_dir`` (which the sensor may have reached through a link inside its root)."""
    top = os.open(role_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield ((Path(folder), files, fd) for folder, _, files, fd in os.fwalk(".", dir_fd=top))
    finally:
        os.close(top)


def _link_tree(role_dir: Path, key_fd: int, folder: Path, inside: Path) -> dict[str, Identity]:
    """Hard-link every file below ``role_dir`` into the key folder, below ``inside``, in folders made
    0700; the identity of each link made."""
    made = {}
    with contextlib.ExitStack() as opened:
        top = key_fd
        for part in inside.parts:
            top = open_own_folder(top, folder / part, create=True, private=True)
            opened.callback(os.close, top)
        copies = {Path("."): top}  # each folder of the step -> the descriptor of its copy in the pin
        walk = opened.enter_context(_walked(role_dir))
        for relative, files, source_fd in walk:
            if relative not in copies:  # top down: its parent's copy is made
                copies[relative] = open_own_folder(
                    copies[relative.parent], folder / inside / relative, create=True, private=True
                )
                opened.callback(os.close, copies[relative])
            for name in files:
                os.link(name, name, src_dir_fd=source_fd, dst_dir_fd=copies[relative], follow_symlinks=False)
                linked = os.stat(name, dir_fd=copies[relative], follow_symlinks=False)
                made[str(inside / relative / name)] = _identity(linked)
    return made


def _write_record(key_fd: int, folder: Path, key: CheckpointName, files: dict[str, Identity]) -> None:
    """The record, written last (a pin without one is never read), as a new file of ours, 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(RECORD, flags, 0o600, dir_fd=key_fd), "w") as record:
        json.dump({"key": str(key), "files": files}, record)


def _verified_files(owner: int, folder: Path, key: CheckpointName) -> dict[str, Identity]:
    """The files of the pin at ``folder`` (opened in ``owner``), if it is ours throughout (0700 folders)
    and holds exactly the files its record lists; else MergeError naming what differs."""
    key_fd = open_own_folder(owner, folder, create=False, private=True)
    try:
        recorded = _read_record(key_fd, folder / RECORD, key)
        found = {}
        for parent, folders, files, parent_fd in os.fwalk(".", dir_fd=key_fd):
            relative = Path(parent)
            for name in folders:  # fwalk lists a symlink to a folder here (and never enters it): refused
                os.close(open_own_folder(parent_fd, folder / relative / name, create=False, private=True))
            for name in files:
                if relative != Path(".") or name != RECORD:
                    found[str(relative / name)] = _identity(os.stat(name, dir_fd=parent_fd, follow_symlinks=False))
    finally:
        os.close(key_fd)
    if found != recorded:
        differs = sorted(set(found) ^ set(recorded)) or sorted(n for n in found if found[n] != recorded[n])
        raise MergeError(
            folder / differs[0],
            "is not the file recorded when the step was pinned (added, removed or replaced since): the pin is not read",
        )
    return found


def _read_record(key_fd: int, path: Path, key: CheckpointName) -> dict[str, Identity]:
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=key_fd)
    except FileNotFoundError:
        raise MergeError(path, "is missing: the pin was cut short, and is not read") from None
    with os.fdopen(fd, "rb") as record:
        if refuse_planted_fd(fd, path, stat.S_IFREG, dir_fd=key_fd).st_size > MAX_RECORD_BYTES:
            raise MergeError(path, "is too large to be a pin record")
        try:
            content = json.loads(record.read(MAX_RECORD_BYTES + 1))
            files = {name: tuple(identity) for name, identity in content["files"].items()}
            if content["key"] == str(key) and all(
                len(i) == 4 and all(type(n) is int for n in i) for i in files.values()
            ):
                return files
        except (ValueError, TypeError, KeyError, AttributeError):
            pass
    raise MergeError(path, f"is not the record of a pin of {key}: the pin is not read")


def _identity(found: os.stat_result) -> Identity:
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
