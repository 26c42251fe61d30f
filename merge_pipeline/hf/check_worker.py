"""The blocking checks in a process of their own, started as the weights start being written.

``start_beside`` (``pipeline.write_side_files``, just before the weights) starts a fresh interpreter
that imports transformers and the modeling module of the class config.json names, and builds
transformers' table of checkpoint renamings: ~3-5 s of CPU that a thread of the merging process
would spend holding the GIL its writer threads need at every chunk. The worker then waits.
``checks_on`` (``pipeline.check_before_publishing``, once the folder is complete) sends it the write
report's entries; it runs ``blocking_checks.run_blocking_checks`` on the folder, the same functions
on the same folder as in the merging process, and answers each check's problems. So the merging
process never imports transformers for the checks (a FSDP merge imports none of it).

The worker only saves time: one that died, answered something else or is hung (owes an answer and
used no CPU for ``STALLED_AFTER_S``) is killed, the merge logs one warning line and runs the same
checks in its own process, as before the worker existed. A worker not asked exits by itself once
its folder is gone (a failed merge removes its staging folder) or the merging process has ended.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

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
    """The merging process's handle on one worker: its process, pipes and the stderr it wrote."""

    def __init__(self, config: Mapping, folder: Path) -> None:
        self.stderr = tempfile.TemporaryFile()  # a file, not a pipe: a talkative worker never blocks on it
        boot = {
            "folder": str(folder),
            "architecture": str((config.get("architectures") or [""])[0]),
            "model_type": str(config.get("model_type", "")),
        }
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from merge_pipeline.hf.check_worker import serve; serve()", json.dumps(boot)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            # the same merge_pipeline and packages as this process, wherever it found them
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )

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
        into, out = self.process.stdin.fileno(), self.process.stdout.fileno()
        os.set_blocking(into, False)
        answer = b""
        cpu, progressed = self._cpu_ticks(), time.monotonic()
        while b"\n" not in answer:
            readable, writable, _ = select.select([out], [into] if request else [], [], _POLL_S)
            if writable:
                try:
                    request = request[os.write(into, request) :]
                except BrokenPipeError:  # it ended before reading it all: its exit says why
                    request = b""
                if not request:
                    self.process.stdin.close()
            if readable:
                chunk = os.read(out, 1 << 16)
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
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if fields[0] in ("T", "t", "Z", "X"):  # stopped or exited: no work is being done
            return None
        return int(fields[11]) + int(fields[12])

    def _ended(self) -> str:
        code = self.process.wait()
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        return how + (f" ({lines[-1]})" if lines else "") + " before answering"

    def stop(self) -> None:
        """End the worker and reap it (its CPU and peak RSS then count in this process's children's)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.stderr):
            stream.close()


def start_beside(config: Mapping, folder: Path) -> None:
    """Start preparing, in a worker, the checks of ``folder`` (for a model with this config.json)."""
    for earlier in [f for f, w in _workers.items() if f == folder or w.process.poll() is not None]:
        _workers.pop(earlier).stop()  # a merge that failed before its checks left it (ended, or this folder's)
    try:
        _workers[folder] = CheckWorker(config, folder)
    except OSError as exc:  # no interpreter to start: the checks will run in this process
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


def serve() -> None:
    """The worker: prepare the checks, then answer the one request on stdin about its folder."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed while importing or checking goes to stderr, not into the answer
    boot = json.loads(sys.argv[1])
    folder = Path(boot["folder"])
    prepare_checks(boot["architecture"], boot["model_type"])
    request = _request(folder)
    if request is None:
        return
    outcomes = run_blocking_checks(folder, json.loads(request)["written"])
    answers.write(json.dumps({"problems": {o.check.name: o.problems for o in outcomes}}) + "\n")
    answers.flush()


def _request(folder: Path) -> bytes | None:
    """The request line; None once the merge ended without asking (its pipe closed, its folder gone)."""
    received = b""
    while b"\n" not in received:
        if not select.select([0], [], [], _IDLE_POLL_S)[0]:
            if not folder.is_dir():
                return None
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        received += chunk
    return received
