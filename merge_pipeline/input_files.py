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
    """A read-only descriptor of ``path``; ``MergeError`` unless it is a regular file.

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
        _require_regular(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def contained_file(path: Path, folder: Path) -> Path:
    """The real path of ``path``, refused unless it lies inside ``folder`` (symlinks resolved).

    A symlink between two files of the checkpoint is fine; one that leaves it is refused.
    """
    real = Path(os.path.realpath(path))
    if not real.is_relative_to(os.path.realpath(folder)):
        raise MergeError(
            path,
            f"is a symlink to {real}, outside the checkpoint folder {folder}: refused (copy the file into the checkpoint if it belongs there)",
        )
    return real


def _require_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise MergeError(path, f"is a {_KINDS.get(stat.S_IFMT(mode), 'special file')}, not a regular file: refused")
