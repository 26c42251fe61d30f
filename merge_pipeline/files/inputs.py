"""Opening checkpoint files safely: regular files only, and side files only from inside the checkpoint.

A FIFO named like a rank file would block ``open`` forever, a device streams without end, and a
symlink can point anywhere (``/proc/self/environ``, ``~/.ssh/id_rsa``): what we copy into a merged
folder may end up public on the Hub, so nothing from outside the checkpoint is ever read into it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from merge_pipeline.errors import MergeError, os_error

_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFDIR: "directory",
}


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``; ``MergeError`` unless it is a regular file (``open_regular_stat``)."""
    return open_regular_stat(path)[0]


def open_regular_stat(path: Path) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its ``fstat``; ``MergeError`` unless it is a regular file.

    Checked with ``stat`` before ``open``, so a FIFO or device is never opened; the open is
    non-blocking and checked again, so one swapped in between cannot block us either.
    (O_NONBLOCK changes nothing for reads of a regular file.)
    """
    try:
        _require_regular(path, os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MergeError(path, "file not found") from None
    except OSError as exc:
        raise os_error(exc, path, doing="cannot open") from None
    try:
        found = os.fstat(fd)
        _require_regular(path, found.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, found


def read_capped(path: Path, limit: int, too_large: str, *, inside: Path | None = None) -> bytes:
    """The whole of a file we do not stream (a tracker, ``latest``, a JSON file, a side file), refused
    above ``limit`` bytes with ``too_large`` as the problem; and unless it lies inside ``inside``, when given.

    Opened once as ``open_regular`` (no FIFO, no device); refused by its size before any read, and
    at most ``limit + 1`` bytes ever read, so a file that is huge, or grows while we read it, costs no
    more memory than the cap.
    """
    with os.fdopen(open_regular(path) if inside is None else open_contained(path, inside), "rb") as f:
        data = f.read(limit + 1) if os.fstat(f.fileno()).st_size <= limit else None
    if data is None or len(data) > limit:
        raise MergeError(path, too_large)
    return data


def open_contained(path: Path, folder: Path) -> int:
    """``open_regular(path)``, refused unless the file opened lies inside ``folder`` (symlinks resolved:
    a symlink between two files of the checkpoint is fine; one that leaves it is refused).

    The check is made on the descriptor (its path as the kernel records it), never on ``path``
    looked up again: a symlink swapped between a check and the open cannot slip a file from
    outside the checkpoint in.
    """
    fd = open_regular(path)
    try:
        require_opened_inside(fd, path, folder)
    except BaseException:
        os.close(fd)
        raise
    return fd


def require_opened_inside(fd: int, path: Path, folder: Path) -> None:
    """Refuse the file open on ``fd`` (opened as ``path``) unless it lies inside ``folder``.

    The one rule for symlinks in a checkpoint, weights and side files alike: a link that stays inside
    the checkpoint folder is followed; one that leads out of it is refused. Where the file is comes
    from the descriptor (``/proc/self/fd``: the path the kernel resolved when opening), not from
    ``path`` looked up again.
    """
    real = Path(os.readlink(f"/proc/self/fd/{fd}"))
    if not real.is_relative_to(os.path.realpath(folder)):
        raise MergeError(
            path,
            f"is a symlink to {real}, outside the checkpoint folder {folder}: refused (copy the file into the checkpoint, or give its real folder)",
        )


def _require_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise MergeError(path, f"is a {_KINDS.get(stat.S_IFMT(mode), 'special file')}, not a regular file: refused")
    if not mode & 0o444:  # refused as well where root could open it: it has none of the bytes it stands for
        raise MergeError(
            path,
            "no one may read it (mode 000; in a store's view: an object's stand-in, read through the store, never opened as a file): refused",
        )
