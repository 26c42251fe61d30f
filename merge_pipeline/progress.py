"""Byte progress: a tqdm bar with throughput on a terminal, a few plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("merge_pipeline")


class ByteProgress:
    """Counts bytes written; callable so it can be handed to writers as ``on_bytes``."""

    def __init__(self, total: int, description: str, *, done: int = 0, enabled: bool = True, log_every: float = 0.1):
        """``done``: bytes already there (a resumed merge's kept files): counted as progress, not as throughput."""
        self.total = max(total, 1)
        self.done = self._already = done
        self.started = time.monotonic()
        self._bar = (
            tqdm(
                total=total,
                initial=done,
                desc=description,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
            )
            if enabled and sys.stderr.isatty()
            else None
        )
        self._description = description
        self._log_every = log_every
        self._next_log = (done / self.total // log_every + 1) * log_every

    def __call__(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.done / self.total >= self._next_log:
            self._next_log = (self.done / self.total // self._log_every + 1) * self._log_every
            log.info(
                "%s: %.0f%% (%s of %s, %s/s)",
                self._description,
                100 * self.done / self.total,
                human_bytes(self.done),
                human_bytes(self.total),
                human_bytes(self.rate),
            )

    @property
    def rate(self) -> float:
        return (self.done - self._already) / max(time.monotonic() - self.started, 1e-9)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
