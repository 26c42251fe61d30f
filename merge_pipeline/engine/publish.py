"""Safe output: a target is written only under its lock, built beside it, and swapped in when complete.

Every writer (the CLI, torchrun rank 0, the Dagster assets) goes through ``locked_target``:

    with locked_target(target, source=role_dir, overwrite=False) as locked:
        staging = locked.new_staging()
        ...  # write the folder into staging
        locked.publish()

Beside ``<parent>/<name>`` live ``.<name>.lock`` (held while anyone touches the staging folder or
the target), ``.<name>.staging`` (the folder being built; the same filesystem, so publishing is a
rename) and, only for a moment during a fallback replace, ``.<name>.previous``. Whatever a killed
writer leaves behind, the next one that takes the lock cleans up or restores, and logs it.

The parent may be a shared folder (``/tmp``, a team folder) where another user can create these
names first: none is ever followed (the lock is opened with ``O_NOFOLLOW`` relative to the parent's
descriptor, the staging folder made by ``mkdir``, which fails on any existing entry), and one found
there that is a symlink, not this user's, or of the wrong type is refused in one line and touched
in no way (``files.shared_folders``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from merge_pipeline.errors import MergeError, naming, os_error
from merge_pipeline.files.inputs import read_capped
from merge_pipeline.files.shared_folders import refuse_planted, refuse_planted_fd
from merge_pipeline.store.record import MANIFEST
from merge_pipeline.store.target_rules import not_ours, refuse_overlap

log = logging.getLogger("merge_pipeline")

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_EXCHANGE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}  # by the kernel or this filesystem
_MAX_MANIFEST_BYTES = 64 * 10**6  # ours lists one line per file; a larger one is not ours


def staging_path(target: Path) -> Path:
    return target.parent / f".{target.name}.staging"


def previous_path(target: Path) -> Path:
    return target.parent / f".{target.name}.previous"


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}.lock"


def check_target(target: Path, *, source: str | Path, overwrite: bool) -> None:
    """Refuse early, before any work, what would destroy data or fail at the end."""
    refuse_overlap(target, [source])
    if target.is_symlink():  # replacing it would swap the link, not the folder it names: be explicit
        raise MergeError(target, f"is a symlink (to {os.readlink(target)}): give the real folder as --target_dir")
    if target.exists() and not overwrite:
        raise MergeError(target, "already exists (pass --overwrite to replace it once the new merge is complete)")
    if target.exists():
        _refuse_foreign(target)
    parent = _existing_ancestor(target.parent)
    if not parent.is_dir():
        raise MergeError(parent, "is not a directory: cannot create the target under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise MergeError(parent, "is not writable: cannot create the target under it")


class LockedTarget:
    """A target whose lock this process holds: the only way to create its staging folder or publish it."""

    def __init__(self, target: Path, overwrite: bool):
        self.target, self.overwrite = target, overwrite
        self.staging = staging_path(target)

    def new_staging(self, *, keep: bool = False) -> Path:
        """An empty staging folder; one left by a killed writer is removed first, or with ``keep`` left
        as it is (for ``engine.resume`` to sort out)."""
        if refuse_planted(self.staging, stat.S_IFDIR) is not None:
            if keep:
                log.warning(
                    "%s: %s was left by a merge that did not finish: its finished files are checked for reuse",
                    self.target,
                    self.staging,
                )
                return self.staging
            log.warning("%s: removing %s, left by a merge that did not finish", self.target, self.staging)
            shutil.rmtree(self.staging)
        self.staging.mkdir()
        return self.staging

    def discard_staging(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def publish(self) -> None:
        """Put the complete staging folder at the target; an existing target is swapped out only now."""
        target, staging = self.target, self.staging
        with naming(target):
            refuse_planted(staging, stat.S_IFDIR)  # still our folder: in a shared parent it could be swapped
            _fsync_dir(staging)
            if not target.exists():
                os.rename(staging, target)
            elif not self.overwrite:
                raise MergeError(target, "appeared while merging; not replaced (pass --overwrite)")
            else:
                _refuse_foreign(target)  # it may have changed since check_target
                if _exchange(staging, target):
                    shutil.rmtree(
                        staging, ignore_errors=True
                    )  # now the previous target; anything left is removed next time
                else:
                    _replace_with_two_renames(staging, target)
            _fsync_dir(target.parent)


@contextlib.contextmanager
def locked_target(target: str | Path, *, source: str | Path, overwrite: bool) -> Iterator[LockedTarget]:
    """Hold the target's lock: refuse if another writer holds it, recover what a killed one left, re-check."""
    target = Path(target).absolute()
    check_target(target, source=source, overwrite=overwrite)
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # deepest first
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, target.parent, doing="cannot create") from None
    try:
        with _exclusive_lock(target):
            with naming(target):
                _restore_or_remove_previous(target)
            check_target(target, source=source, overwrite=overwrite)  # a restored previous target counts
            yield LockedTarget(target, overwrite)
    finally:
        if not target.exists():
            _remove_if_empty(made)


@contextlib.contextmanager
def published_locked(target: str | Path) -> Iterator[None]:
    """The target's lock alone, for a change made in place to a published folder (an evaluation's entry in
    its manifest): no merge replaces the folder meanwhile; one under way makes this refuse in one line."""
    with _exclusive_lock(Path(target).absolute()):
        yield


def _remove_if_empty(folders: list[Path]) -> None:
    """A merge that published nothing leaves no empty ``global_step_<N>/`` it made in the output root. A folder
    another merge has put its lock, staging folder or target in meanwhile is not empty, and stays."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def staged_output(
    target: str | Path, *, source: str | Path, overwrite: bool, keep_killed: bool = False
) -> Iterator[Path]:
    """Yield an empty staging folder; on success publish it as ``target``, on failure remove it.

    ``keep_killed``: a staging folder left by a killed merge is yielded as it is (``engine.resume``)."""
    with locked_target(target, source=source, overwrite=overwrite) as locked:
        staging = locked.new_staging(keep=keep_killed)
        try:
            yield staging
            locked.publish()
        finally:
            locked.discard_staging()


def _refuse_foreign(target: Path) -> None:
    """Only a folder this tool wrote (our manifest) or an empty one may be replaced."""
    if not target.is_dir():
        raise MergeError(target, "exists and is not a directory")
    if not any(target.iterdir()) or _written_by_us(target):
        return
    raise not_ours(target)


def _written_by_us(folder: Path) -> bool:
    try:  # capped and non-blocking: a FIFO or a huge file there is simply not our manifest
        manifest = json.loads(read_capped(folder / MANIFEST, _MAX_MANIFEST_BYTES, "too large to be our manifest"))
    except (MergeError, OSError, ValueError):
        return False
    return (
        isinstance(manifest, dict)
        and isinstance(manifest.get("tool"), dict)
        and manifest["tool"].get("name") == "merge_pipeline"
    )


def _restore_or_remove_previous(target: Path) -> None:
    """``.previous`` exists only if a fallback replace was killed: between its renames, or before the cleanup."""
    previous = previous_path(target)
    if refuse_planted(previous, stat.S_IFDIR) is None:
        return
    if target.exists():
        log.warning("%s: removing %s, the replaced folder a killed merge left behind", target, previous)
        shutil.rmtree(previous)
    else:
        os.rename(previous, target)
        log.warning("%s: restored from %s: a merge was killed while replacing it", target, previous)


def _libc_renameat2():
    function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
    return function


_renameat2 = _libc_renameat2()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step, so ``b`` never goes missing; False where the kernel or filesystem cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code), str(b))


def _replace_with_two_renames(staging: Path, target: Path) -> None:
    """Without an exchange, the target is missing for a moment; a kill then leaves ``.previous`` to restore."""
    previous = previous_path(target)
    os.rename(target, previous)
    os.rename(staging, target)
    shutil.rmtree(previous, ignore_errors=True)


@contextlib.contextmanager
def _exclusive_lock(target: Path) -> Iterator[None]:
    path = lock_path(target)
    with naming(path):
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fd = _open_locked(parent, path, target)
        except BaseException:
            os.close(parent)
            raise
    try:
        yield
    finally:
        # Unlinked while still held: whoever opened this file meanwhile sees that it is gone and retries.
        # Only our own file: an entry someone put in its place meanwhile is not ours to remove.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path.name, dir_fd=parent, follow_symlinks=False)):
                os.unlink(path.name, dir_fd=parent)
        os.close(fd)
        os.close(parent)


def _open_locked(parent: int, path: Path, target: Path) -> int:
    """A descriptor holding the flock on the file that is at ``path`` now, not on one unlinked meanwhile.

    Opened relative to the ``parent`` folder's descriptor and never through a symlink; a lock file
    that is not a regular file of this user's is refused before anything is read or written.
    """
    while True:
        try:
            fd = os.open(path.name, _LOCK_FLAGS, 0o644, dir_fd=parent)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
                refuse_planted(path, stat.S_IFREG)
            raise
        try:
            refuse_planted_fd(fd, path, stat.S_IFREG)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid_in(fd)
            os.close(fd)
            raise MergeError(
                target, f"another merge{f' (pid {holder})' if holder else ''} is writing this target right now"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path.name, dir_fd=parent, follow_symlinks=False)):
                break
        os.close(fd)  # the holder unlinked it between our open and our flock: lock the new file
    stale = _pid_in(fd)
    if stale:
        log.warning("%s: the merge holding it (pid %s) was killed; cleaning up after it", path, stale)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _pid_in(fd: int) -> str | None:
    """The pid a lock file holds, or None: anything else in it (forged lines, escape codes) is never shown."""
    content = os.pread(fd, 32, 0)
    return content.decode().strip() if re.fullmatch(rb"\d{1,10}\n?", content) else None


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
