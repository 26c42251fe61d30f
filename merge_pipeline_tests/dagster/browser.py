"""Headless Debian Chromium: what a person sees at a URL (a screenshot) and the page it renders (the DOM)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"  # Debian's package `chromium`
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1600,1000",
    "--virtual-time-budget=15000",
]


def _run(url: str, *output_flags: str, timeout: float = 120) -> str:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        command = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *output_flags, url]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = process.communicate(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # chromium's helper processes too, whatever happened
            process.wait()
    assert process.returncode == 0, err[-2000:]
    return out


def dump_dom(url: str) -> str:
    return _run(url, "--dump-dom")


def screenshot(url: str, path: Path) -> None:
    _run(url, f"--screenshot={path}")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"


def dump_dom_showing(url: str, *texts: str, attempts: int = 4) -> str:
    """The page once it shows every one of ``texts``: on a loaded machine the UI may still be
    fetching when the virtual time budget runs out, so look again a few times."""
    for _ in range(attempts):
        dom = dump_dom(url)
        if all(t in dom for t in texts):
            return dom
    return dom
