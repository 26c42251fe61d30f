"""Measurements: a child process's wall time and peak RSS, page-cache control, the raw I/O baseline."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

COPY_BUFFER = 16 * 1024 * 1024


@dataclass
class ChildRun:
    wall_s: float
    peak_rss_bytes: int  # ru_maxrss of exactly this child, from wait4
    cpu_s: float  # user + system CPU seconds of the child (less sensitive to other load than wall time)
    returncode: int
    output: str  # stdout + stderr, last few KB

    def check(self, what: str) -> ChildRun:
        if self.returncode != 0:
            raise RuntimeError(f"{what} exited with {self.returncode}:\n{self.output}")
        return self


def run_child(
    command: Sequence[str],
    *,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: float = 3600,
    stop_when: Callable[[], bool] | None = None,
) -> ChildRun:
    """Run ``command``; wall time from spawn to reap, peak RSS from ``os.wait4`` on its pid.

    ``stop_when``: asked twice a second; once it says True the child's process group is killed
    (e.g. when the disk is nearly full).

    ``wait4`` gives this child's own ``ru_maxrss`` (not the max over every child, as
    ``RUSAGE_CHILDREN`` would). Linux carries the parent's high-water mark across exec into the
    child's figure, so the runner must stay small: it never imports torch.
    """
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        process = subprocess.Popen(
            list(command), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        timer = threading.Timer(timeout, lambda: _kill_group(process.pid))
        timer.start()
        done = threading.Event()
        if stop_when is not None:
            threading.Thread(target=_stop_when, args=(stop_when, process.pid, done), daemon=True).start()
        try:
            _, status, usage = os.wait4(process.pid, 0)
        finally:
            timer.cancel()
            done.set()
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        output = log.read()[-8000:].decode(errors="replace")
    return ChildRun(wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime, process.returncode, output)


def _stop_when(stop_when: Callable[[], bool], pid: int, done: threading.Event) -> None:
    while not done.wait(0.5):
        if stop_when():
            _kill_group(pid)
            return


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session: this ends only what it started
    except ProcessLookupError:
        pass


def files_under(paths: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        path = Path(path)
        out.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    return out


def evict(paths: Iterable[Path]) -> None:
    """Drop these files' pages from the page cache (cold reads); other files' pages stay.

    ``posix_fadvise(DONTNEED)`` needs no privileges and leaves the interpreter's own libraries
    cached, so start-up cost stays the same in every measurement.
    """
    for path in files_under(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Iterable[Path]) -> None:
    """Read these files once so that they are in the page cache (warm reads)."""
    buffer = bytearray(COPY_BUFFER)
    for path in files_under(paths):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def prepare_cache(paths: Iterable[Path], mode: str) -> None:
    os.sync()  # no writeback left over from the previous measurement
    if mode == "cold":
        evict(paths)
    elif mode == "drop":
        drop_page_cache()
    else:
        warm(paths)


def drop_page_cache() -> None:
    """Drop every clean page, dentry and inode from the caches (root only): a cold machine."""
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except PermissionError:
        raise SystemExit("--cache drop writes /proc/sys/vm/drop_caches: run as root, or use --cache cold") from None


def raw_copy(inputs: Sequence[Path], output: Path, output_bytes: int) -> float:
    """The raw baseline: read every input byte once, write ``output_bytes`` to ``output``, fsync.

    Plain ``read``/``write`` system calls through one 16 MiB buffer, in this (already running)
    process: no start-up, no parsing, no per-element work. Returns the seconds taken.
    """
    buffer = bytearray(COPY_BUFFER)
    view = memoryview(buffer)
    started = time.perf_counter()
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = output_bytes
        for path in inputs:
            fd = os.open(path, os.O_RDONLY)
            try:
                while n := os.readv(fd, [buffer]):
                    if left > 0:
                        left -= _write_all(out, view[: min(n, left)])
            finally:
                os.close(fd)
        while left > 0:  # more output than input: write zeros
            left -= _write_all(out, view[: min(len(view), left)])
        os.fsync(out)
    finally:
        os.close(out)
    return time.perf_counter() - started


def _write_all(fd: int, data: memoryview) -> int:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
    return done


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def weight_bytes(hf_dir: Path) -> int:
    """Bytes of the safetensors files in an HF folder (headers included)."""
    return sum(p.stat().st_size for p in Path(hf_dir).rglob("*.safetensors"))
