"""Engine errors become a failed step whose description is the engine's one line, not a traceback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import dagster as dg

from merge_pipeline.errors import MergeError, os_error


@contextlib.contextmanager
def one_line_failure() -> Iterator[None]:
    try:
        yield
    except MergeError as exc:
        raise dg.Failure(description=str(exc)) from None
    except OSError as exc:  # disk full, permission denied, ...: name the file, as the CLI does
        raise dg.Failure(description=str(os_error(exc))) from None
