"""The one error type users see: a single line naming the file and what is wrong with it."""

from __future__ import annotations

from pathlib import Path


class MergeError(Exception):
    """A problem with the input or the target that the user must fix.

    The CLI prints ``str(error)`` as one line and exits non-zero; Dagster shows the same line.
    """

    def __init__(self, path: str | Path | None, problem: str):
        self.path = Path(path) if path is not None else None
        self.problem = " ".join(str(problem).split())  # always one line
        super().__init__(f"{self.path}: {self.problem}" if self.path is not None else self.problem)
