"""Atomic output: build beside the target, rename into place only when complete.

The staging folder lives in the target's parent (same filesystem, so the final rename is atomic).
An exclusive lock beside it stops two merges writing one target; a stale staging folder left by a
killed merge is removed by the next run that takes the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from merge_pipeline.errors import MergeError


def staging_path(target: Path) -> Path:
    return target.parent / f".{target.name}.staging"


def check_target(target: Path, *, overwrite: bool) -> None:
    """Refuse early, before any work, what would fail at the end."""
    if target.is_symlink():  # replacing it would swap the link, not the folder it names: be explicit
        raise MergeError(target, f"is a symlink (to {os.readlink(target)}): give the real folder as --target_dir")
    if target.exists() and not overwrite:
        raise MergeError(target, "already exists (pass --overwrite to replace it once the new merge is complete)")
    if target.exists() and not target.is_dir():
        raise MergeError(target, "exists and is not a directory")
    parent = _existing_ancestor(target.parent)
    if not parent.is_dir():
        raise MergeError(parent, "is not a directory: cannot create the target under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MergeError(parent, "is not writable: cannot create the target under it")


@contextlib.contextmanager
def staged_output(target: Path, *, overwrite: bool) -> Iterator[Path]:
    """Yield an empty staging folder; on success publish it as ``target``, on failure remove it."""
    target = target.absolute()
    check_target(target, overwrite=overwrite)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MergeError(target.parent, f"cannot create: {exc.strerror}") from None
    with _exclusive_lock(target):
        staging = staging_path(target)
        shutil.rmtree(staging, ignore_errors=True)  # a killed merge's leftovers
        staging.mkdir()
        try:
            yield staging
            publish(staging, target, overwrite=overwrite)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, target: Path, *, overwrite: bool) -> None:
    """Rename ``staging`` to ``target``; an existing target is replaced only now, when the new one is whole."""
    _fsync_dir(staging)
    if target.exists():
        if not overwrite:
            raise MergeError(target, "appeared while merging; not replaced (pass --overwrite)")
        previous = target.parent / f".{target.name}.previous"
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(target, previous)
        os.rename(staging, target)
        shutil.rmtree(previous)
    else:
        os.rename(staging, target)
    _fsync_dir(target.parent)


@contextlib.contextmanager
def _exclusive_lock(target: Path) -> Iterator[None]:
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MergeError(target, "another merge is writing this target right now") from None
        try:
            yield
        finally:
            lock_path.unlink(missing_ok=True)


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
