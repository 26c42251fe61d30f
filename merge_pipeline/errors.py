"""The one error type users see: a single line naming the file and what is wrong with it."""

from __future__ import annotations

from pathlib import Path


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``, ``\\udcff``, ...).

    A file name can hold a newline or a terminal escape code: printed raw it would break the
    one-line rule, forge a line of output, or recolour the terminal. Printable text is kept as is.
    """
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text)


class MergeError(Exception):
    """A problem with the input or the target that the user must fix.

    The CLI prints ``str(error)`` as one line and exits non-zero; Dagster shows the same line.
    """

    def __init__(self, path: str | Path | None, problem: str):
        self.path = Path(path) if path is not None else None
        self.problem = printable(" ".join(str(problem).split()))  # always one line
        super().__init__(f"{printable(str(self.path))}: {self.problem}" if self.path is not None else self.problem)
