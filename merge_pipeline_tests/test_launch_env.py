"""torchrun mode only under torchrun; a rank that stops answering fails the others in bounded time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from safetensors.torch import load_file

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.dagster.services import free_port
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits, torchrun

SPEC = FsdpSpec(world_size=3, with_optimizer=False)
DIST_TIMEOUT = 20


def test_leftover_torch_distributed_variables_merge_in_one_process(tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(SPEC)
    plain_shell = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "LOCAL_", "GROUP_"))}
    leftovers = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}

    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "merge_pipeline",
            "merge",
            "--local_dir",
            sample.role_dir,
            "--target_dir",
            tmp_path / "out",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**plain_shell, **leftovers},
    )

    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 60
    assert "WORLD_SIZE=2 is set but torchrun did not start this process: merging in this one process" in done.stderr
    merged = load_safetensors_dir(tmp_path / "out")
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert merged.keys() == reference.keys()
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor), name


@pytest.mark.torchrun
def test_a_stopped_rank_fails_the_other_within_the_timeout(tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(SPEC).role_dir
    lines: list[tuple[float, str]] = []
    with torchrun(2, "--local_dir", role_dir, "--target_dir", tmp_path / "out", "--dist-timeout", DIST_TIMEOUT) as run:
        reader = threading.Thread(
            target=lambda: lines.extend((time.monotonic(), line) for line in run.stderr), daemon=True
        )
        reader.start()
        rank1 = _wait_for_rank(run, "1")
        rank1.send_signal(signal.SIGSTOP)  # hung, not dead: its sockets stay open and silent
        stopped = time.monotonic()
        deadline = stopped + DIST_TIMEOUT + 60  # rank 0 may still be starting (torch import) when rank 1 stops
        while not any(line.startswith("error:") for _, line in lines) and time.monotonic() < deadline:
            time.sleep(0.2)
        # torchrun starts each rank in its own session, and would wait out a grace period for the
        # stopped one: kill it and torchrun's group here, so stderr closes and the reader ends.
        rank1.kill()
        os.killpg(run.pid, signal.SIGKILL)
        reader.join(timeout=60)
    [(when, line)] = [(when, line) for when, line in lines if line.startswith("error:")]
    assert "rank 0: another rank stopped answering" in line and "--dist-timeout" in line, line
    assert when - stopped < DIST_TIMEOUT + 60
    assert not (tmp_path / "out").exists()


def _wait_for_rank(run: subprocess.Popen, rank: str, timeout: float = 60) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert run.poll() is None, f"torchrun ended before rank {rank} could be found: {run.stderr.read()}"
        for child in psutil.Process(run.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == rank:
                    return child
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        time.sleep(0.01)
    raise TimeoutError(f"torchrun started no rank {rank} within {timeout} s")
