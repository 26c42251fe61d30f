"""The blocking checks in a process of their own, started as the weights start being written.

``start_beside`` (``pipeline.folder.write_side_files``, just before the weights) forks the merging process:
the child, which has torch already, imports transformers and the modeling module of the class
config.json names and builds transformers' table of checkpoint renamings (~2-3 s of CPU that a
thread of the merging process would spend holding the GIL its writer threads need at every chunk),
then waits. ``checks_on`` (``pipeline.folder.check_before_publishing``, once the folder is complete) sends
it the write report's entries; it runs ``blocking_checks.run_blocking_checks`` on the folder, the
same functions on the same folder as in the merging process, and answers each check's problems. So
the merging process never imports transformers for the checks (a FSDP merge imports none of it).

The worker only saves time: one that died, answered something else or is hung (owes an answer and
used no CPU for ``STALLED_AFTER_S``: a fork of a process whose other threads held a lock can be) is
killed, the merge logs one warning line and runs the same checks in its own process, as before the
worker existed. A worker not asked exits by itself once its folder is gone (a failed merge removes
its staging folder) or the merging process has ended (its pipe closes).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from merge_pipeline.hf.blocking_checks import (
    BLOCKING_CHECKS,
    CHECK_NAMES,
    CheckOutcome,
    Written,
    prepare_checks,
    run_blocking_checks,
)

log = logging.getLogger("merge_pipeline")

# A worker that owes an answer and has used no CPU this long is hung (stopped, deadlocked, blocked).
# Time alone bounds nothing useful: a healthy meta-device load of a large MoE takes tens of seconds.
STALLED_AFTER_S = 30.0
_POLL_S = 0.1  # how often the merge looks at a worker that owes an answer
_IDLE_POLL_S = 1.0  # how often a waiting worker looks whether its folder is still there

# The started workers of this process, by the folder they will check (concurrent merges each have one).
_workers: dict[Path, CheckWorker] = {}


class WorkerFailed(Exception):
    """Why the worker gave no answer; the checks then run in this process."""


class CheckWorker:
    """The merging process's handle on one worker: its pid and the two pipes' ends it keeps."""

    def __init__(self, config: Mapping, folder: Path) -> None:
        architecture = str((config.get("architectures") or [""])[0])
        model_type = str(config.get("model_type", ""))
        request_r, self.requests = os.pipe()
        self.answers, answer_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):  # else the child could write their buffers a second time
            stream.flush()
        self.status: int | None = None
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self.requests)  # so it reads the end of its requests when this process ends
            os.close(self.answers)
            _serve(folder, architecture, model_type, request_r, answer_w)
        os.close(request_r)
        os.close(answer_w)

    def ask(self, written: Written) -> dict[str, list[str]]:
        """Each blocking check's problems on the folder, from the worker; ``WorkerFailed`` otherwise."""
        request = json.dumps({"written": {name: dict(entry) for name, entry in written.items()}}) + "\n"
        answer = json.loads(self._exchange(request.encode()))
        problems = answer.get("problems") if isinstance(answer, dict) else None
        if not isinstance(problems, dict) or sorted(problems) != sorted(CHECK_NAMES):
            raise WorkerFailed(f"answered something else than the problems of {', '.join(CHECK_NAMES)}")
        return problems

    def _exchange(self, request: bytes) -> str:
        """Send ``request`` and read the one line answered, waiting as long as the worker uses CPU:
        never blocked on a full pipe (a request of many files is larger than one)."""
        os.set_blocking(self.requests, False)
        answer = b""
        cpu, progressed = self._cpu_ticks(), time.monotonic()
        while b"\n" not in answer:
            readable, writable, _ = select.select([self.answers], [self.requests] if request else [], [], _POLL_S)
            if writable:
                try:
                    request = request[os.write(self.requests, request) :]
                except BrokenPipeError:  # it ended before reading it all: its exit says why
                    request = b""
            if readable:
                chunk = os.read(self.answers, 1 << 16)
                if not chunk:
                    raise WorkerFailed(self._ended())
                answer += chunk
            now = self._cpu_ticks()
            if now != cpu or readable or writable:
                cpu, progressed = now, time.monotonic()
            elif time.monotonic() - progressed > STALLED_AFTER_S:
                raise WorkerFailed(f"owed an answer and used no CPU for {STALLED_AFTER_S:g} s: hung")
        return answer.split(b"\n", 1)[0].decode()

    def _cpu_ticks(self) -> int | None:
        """The worker's user + system CPU (Linux's /proc; None when stopped, gone or elsewhere)."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if fields[0] in ("T", "t", "Z", "X"):  # stopped or exited: no work is being done
            return None
        return int(fields[11]) + int(fields[12])

    def _ended(self) -> str:
        code = self._wait(0)
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        return how + " before answering"

    def _wait(self, options: int) -> int | None:
        """Its exit code (negative: the signal), reaping it; None while it runs (``os.WNOHANG``)."""
        if self.status is None:
            pid, status = os.waitpid(self.pid, options)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def ended(self) -> bool:
        return self._wait(os.WNOHANG) is not None

    def stop(self) -> None:
        """End the worker and reap it (its CPU and peak RSS then count in this process's children's)."""
        if not self.ended():
            os.kill(self.pid, signal.SIGKILL)
            self._wait(0)
        for end in (self.requests, self.answers):
            os.close(end)


def start_beside(config: Mapping, folder: Path) -> None:
    """Start preparing, in a worker, the checks of ``folder`` (for a model with this config.json)."""
    for earlier in [f for f, w in _workers.items() if f == folder or w.ended()]:
        _workers.pop(earlier).stop()  # a merge that failed before its checks left it (ended, or this folder's)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # CUDA cannot be used in a fork (torch refuses)
        return  # the checks will run in this process
    try:
        _workers[folder] = CheckWorker(config, folder)
    except OSError as exc:  # no process to start: the checks will run in this process
        log.warning("%s: no worker for the blocking checks (%s): they will run in this process", folder, exc)


def checks_on(folder: Path, written: Written) -> list[CheckOutcome]:
    """Every blocking check's outcome on the complete ``folder``: from its worker when one was started
    and answers, else run here (the same functions either way)."""
    worker = _workers.pop(folder, None)
    if worker is not None:
        try:
            problems = worker.ask(written)
        except (WorkerFailed, ValueError) as exc:  # ValueError: an answer that is not JSON
            log.warning("%s: the blocking checks' worker %s: running them in this process", folder, exc)
        else:
            return [CheckOutcome(check, problems[check.name]) for check in BLOCKING_CHECKS]
        finally:
            worker.stop()
    return run_blocking_checks(folder, written)


def _serve(folder: Path, architecture: str, model_type: str, requests: int, answers: int) -> NoReturn:
    """The worker, in the forked child: prepare the checks, answer the one request about its folder,
    and leave without running anything of the merging process (its atexit, finalizers, buffers)."""
    code = 1
    try:
        gc.freeze()  # objects of the merging process, garbage included, are never finalized here
        _own_logging()
        # torch's intra-op pool (OpenMP) does not survive a fork: once the parent has used it, a parallel
        # op in the child waits for threads that are not there (measured: a matmul hangs). One thread.
        import torch  # already imported: the merge that forked this child runs on it

        torch.set_num_threads(1)
        prepare_checks(architecture, model_type)
        request = _request(folder, requests)
        if request is not None:
            outcomes = run_blocking_checks(folder, json.loads(request)["written"])
            answer = (json.dumps({"problems": {o.check.name: o.problems for o in outcomes}}) + "\n").encode()
            while answer:
                answer = answer[os.write(answers, answer) :]
            code = 0
    except BaseException:  # noqa: BLE001 - the merge sees the exit status and runs the checks itself
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def _own_logging() -> None:
    """Records of the worker go to stderr only: a handler of the merging process (Dagster's, writing
    to its instance's storage) must not be used from a fork."""
    for logger in [logging.root, *logging.root.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger):
            logger.handlers.clear()
    logging.root.addHandler(logging.StreamHandler(sys.stderr))


def _request(folder: Path, requests: int) -> bytes | None:
    """The request line; None once the merge ended without asking (its pipe closed, its folder gone)."""
    received = b""
    while b"\n" not in received:
        if not select.select([requests], [], [], _IDLE_POLL_S)[0]:
            if not folder.is_dir():
                return None
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:
            return None
        received += chunk
    return received
