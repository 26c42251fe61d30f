"""Run a command that dies with the process that started it: ``python -m merge_pipeline.workers.die_with_parent CMD ...``.

Dagster's torchrun launcher starts torchrun through this, and each rank asks the same for itself
(``die_with_parent()``): a run worker killed mid-merge (SIGKILL, the OOM killer) takes torchrun and its
ranks with it, instead of leaving orphans writing into the staging folder that the instance's retry of
the run resumes from.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """SIGKILL this process when the thread that started it exits (Linux; kept across exec)."""
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    die_with_parent()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
