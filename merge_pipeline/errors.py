"""The one error type users see: a single line naming the file and what is wrong with it."""

from __future__ import annotations

import contextlib
import os
import reprlib
from collections.abc import Iterator
from pathlib import Path


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``, ``\\udcff``, ...).

    A file name can hold a newline or a terminal escape code: printed raw it would break the
    one-line rule, forge a line of output, or recolour the terminal. Printable text is kept as is.
    """
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text
    )


_BOUNDED = reprlib.Repr()
_BOUNDED.maxlevel, _BOUNDED.maxstring, _BOUNDED.maxother, _BOUNDED.maxlong = 3, 60, 60, 40


def shown(value: object) -> str:
    """``repr(value)`` cut short while it is built, for a value read from a checkpoint: a crafted pickle's
    tuple nested and shared 40 deep has a 10^12-character repr, which ``f"{value!r:.80}"`` builds first."""
    return _BOUNDED.repr(value)


# Local folders standing for store prefixes (``store.view.viewed``): a path inside one is shown as its URL.
_SHOWN_AS: dict[Path, str] = {}


@contextlib.contextmanager
def show_folder_as(folder: Path, url: str) -> Iterator[None]:
    """While the block runs, a path inside ``folder`` is shown in errors as the same key under ``url``."""
    _SHOWN_AS[Path(folder).absolute()] = url.rstrip("/")
    try:
        yield
    finally:
        _SHOWN_AS.pop(Path(folder).absolute(), None)


def shown_path(path: str | Path) -> str:
    """``path`` as users know it: a URL for a file in a store's local view, else the path."""
    for folder, url in list(_SHOWN_AS.items()):
        if Path(path).is_relative_to(folder):
            relative = Path(path).relative_to(folder).as_posix()
            return url if relative == "." else f"{url}/{relative}"
    return str(path)


class MergeError(Exception):
    """A problem with the input or the target that the user must fix.

    The CLI prints ``str(error)`` as one line and exits non-zero; Dagster shows the same line.
    """

    def __init__(self, path: str | Path | None, problem: str):
        self.path = Path(path) if path is not None else None
        self.problem = printable(" ".join(str(problem).split()))  # always one line
        super().__init__(
            f"{printable(shown_path(self.path))}: {self.problem}" if self.path is not None else self.problem
        )


class StoreUnavailable(MergeError):
    """A store that failed (5xx, throttled, connection lost) after its library's retries: nothing is wrong
    with the input, so a later run may succeed (Dagster's instance retries such a run, never a MergeError)."""


def os_error(exc: OSError, path: str | Path | None = None, *, doing: str | None = None) -> MergeError:
    """The one line for an OSError: the file the OS names, else ``path`` (write, fsync and copy errors name none),
    and the OS's words, after ``doing`` ("cannot open") when given."""
    named = exc.filename if isinstance(exc.filename, (str, os.PathLike)) else None  # not a descriptor number
    problem = exc.strerror or str(exc)
    return MergeError(named or path, f"{doing}: {problem}" if doing else problem)


def first_line(message: object) -> str:
    """The first line of an exception's (or a server's) message, "" if it has none: a library's long message,
    cut to name the cause."""
    return (str(message).strip().splitlines() or [""])[0]


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Turn an OSError in the block (disk full, permission) into a MergeError that names a file."""
    try:
        yield
    except OSError as exc:
        raise os_error(exc, path) from None
