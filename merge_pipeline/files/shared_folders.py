"""Our entries in folders other users can write to (``/tmp``, a team folder, a shared checkpoint root).

Another user can create a name there first: a symlink to one of our files or folders, an entry of
theirs, or one of the wrong type. None is ever followed: entries are opened with ``O_NOFOLLOW``
relative to their parent's descriptor and checked on what was opened; one that is a symlink, not
ours or of the wrong type is refused in one line and left exactly as it is. Used by the target's
lock, staging and previous entries (``engine.publish``) and by the Dagster pins (``dagster.pins``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from merge_pipeline.errors import MergeError

_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KIND_NAMES = {stat.S_IFDIR: "folder", stat.S_IFREG: "regular file"}


def refuse_planted(path: Path, kind: int, *, dir_fd: int | None = None) -> os.stat_result | None:
    """``lstat`` of an entry we are about to reuse, remove or rename (None: absent); with ``dir_fd``,
    ``path.name`` is looked up in that folder (``path`` only names it in the message).

    A symlink (to one of your files), an entry owned by someone else, or one of the wrong type is
    refused, and left exactly as it is.
    """
    name = path if dir_fd is None else path.name
    try:
        found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(found.st_mode):
        problem = f"is a symlink (to {os.readlink(name, dir_fd=dir_fd)})"
    elif found.st_uid != os.geteuid():
        problem = f"belongs to another user (uid {found.st_uid})"
    elif stat.S_IFMT(found.st_mode) != kind:
        problem = f"is not a {_KIND_NAMES[kind]}"
    else:
        return found
    raise MergeError(
        path,
        f"{problem}: not made by merge_pipeline for you; refused and left untouched (remove it if it is not needed)",
    )


def refuse_planted_fd(fd: int, path: Path, kind: int, *, dir_fd: int | None = None) -> os.stat_result:
    """``refuse_planted`` on what was opened: an entry another user put there first is not ours."""
    opened = os.fstat(fd)
    if stat.S_IFMT(opened.st_mode) != kind or opened.st_uid != os.geteuid():
        refuse_planted(path, kind, dir_fd=dir_fd)  # names what is there
        raise MergeError(path, "changed while it was being opened: refused")
    return opened


def open_own_folder(parent: int, path: Path, *, create: bool, private: bool) -> int:
    """A descriptor of our folder ``path.name`` in the folder open on ``parent``, never through a symlink.

    ``create``: made with mode 0700 when absent (else FileNotFoundError). ``private``: refused unless
    no other user can reach inside (what we keep there must never widen who can read a file). An
    entry that is a symlink, another user's or not a folder is refused in one line and left alone.
    """
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path.name, 0o700, dir_fd=parent)
    try:
        fd = os.open(path.name, _FOLDER_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW met a symlink, or not a folder
            refuse_planted(path, stat.S_IFDIR, dir_fd=parent)
        raise
    try:
        opened = refuse_planted_fd(fd, path, stat.S_IFDIR, dir_fd=parent)
        if private and opened.st_mode & 0o077:
            raise MergeError(
                path,
                f"has mode {stat.S_IMODE(opened.st_mode):04o}, so other users can reach what is inside: refused and left untouched (chmod 700 it, or remove it)",
            )
    except BaseException:
        os.close(fd)
        raise
    return fd
