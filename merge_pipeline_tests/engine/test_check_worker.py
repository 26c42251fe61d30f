"""The blocking checks' worker (``hf/check_worker.py``) only saves time: a worker killed or hung
mid-merge leaves the same checks to the merging process, which logs one warning line and accepts or
refuses the folder as the worker would have; a merge that fails before its checks does not leave its
worker running.

The stages are the pipeline's own (side files, weights, finished folder, checks), as every entry point
runs them; the worker is the real process ``write_side_files`` started.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from merge_pipeline.engine.publish import staged_output, staging_path
from merge_pipeline.errors import MergeError
from merge_pipeline.hf import check_worker
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.folder import check_before_publishing, finish_folder, write_side_files
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.workers.writing import write_weights
from merge_pipeline_samples.fsdp import FsdpSpec

SPEC = FsdpSpec(world_size=2, with_optimizer=False)
OPTIONS = MergeOptions(max_shard_size="100KB")  # several weight files
FALLBACK = "the blocking checks' worker {}: running them in this process"


def the_worker() -> int:
    """The pid of this process's one check worker (the child ``write_side_files`` forked)."""
    [worker] = check_worker._workers.values()
    return worker.pid


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def merge_with(fsdp_checkpoint, target, *, to_the_worker, before_checks=lambda staging, report: None):
    """The merge's stages, with ``to_the_worker(pid)`` done right after the worker started (before the
    weights) and ``before_checks(staging, report)`` once the folder is finished; returns the outcomes."""
    role_dir = fsdp_checkpoint(SPEC).role_dir
    with (
        prepare(role_dir, OPTIONS) as prepared,
        staged_output(target, source=role_dir, overwrite=False) as staging,
    ):
        write_side_files(prepared, staging, OPTIONS)
        to_the_worker(the_worker())
        report = write_weights(prepared.outputs, staging, show_progress=False)
        finish_folder(prepared, staging, OPTIONS, report)
        before_checks(staging, report)
        return check_before_publishing(staging, target, report)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_a_worker_killed_mid_merge_leaves_the_checks_to_the_merging_process(tmp_path, fsdp_checkpoint, caplog):
    target = tmp_path / "out"

    outcomes = merge_with(fsdp_checkpoint, target, to_the_worker=kill)

    assert [o.check.name for o in outcomes if o.passed] == CHECK_NAMES
    assert (target / "merge_manifest.json").is_file()
    [warning] = [r.getMessage() for r in caplog.records if "blocking checks' worker" in r.getMessage()]
    assert warning == f"{staging_path(target)}: " + FALLBACK.format("was killed by signal 9 before answering")


def test_a_folder_checked_after_its_worker_died_is_refused_with_the_same_line(tmp_path, fsdp_checkpoint):
    target = tmp_path / "out"

    def add_a_stray_file(staging: Path, report) -> None:
        (staging / "stray.bin").write_bytes(b"not listed")

    with pytest.raises(MergeError) as refused:
        merge_with(fsdp_checkpoint, target, to_the_worker=kill, before_checks=add_a_stray_file)

    assert str(refused.value) == (
        f"{target}: not published: blocking check(s) manifest_sha256 failed on the merged folder: "
        "stray.bin: in the folder, not in the manifest"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_hung_worker_is_given_up_and_the_checks_run_here(tmp_path, fsdp_checkpoint, caplog, monkeypatch):
    """A stopped worker uses no CPU: after ``STALLED_AFTER_S`` without an answer it is killed. The
    request it never reads is larger than a pipe holds (a report of many files): the merge must not
    block writing it."""
    monkeypatch.setattr("merge_pipeline.hf.check_worker.STALLED_AFTER_S", 2.0)
    target = tmp_path / "out"
    stopped = []

    def stop(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    def report_many_files(staging: Path, report) -> None:
        # entries of files not in the folder have no digest to trust: they change no check's outcome
        report.files += [
            {"filename": f"absent-{i}.safetensors", "sha256": "0" * 64, "identity": [0, 0, 0, 0]} for i in range(2000)
        ]

    started = time.monotonic()
    outcomes = merge_with(fsdp_checkpoint, target, to_the_worker=stop, before_checks=report_many_files)

    assert [o.check.name for o in outcomes if o.passed] == CHECK_NAMES
    assert time.monotonic() - started < 120
    assert not Path(f"/proc/{stopped[0]}").exists()  # killed and reaped
    [warning] = [r.getMessage() for r in caplog.records if "blocking checks' worker" in r.getMessage()]
    assert warning.endswith(FALLBACK.format("owed an answer and used no CPU for 2 s: hung")), warning


def test_a_merge_failing_before_its_checks_does_not_leave_its_worker_running(tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(SPEC).role_dir
    with pytest.raises(RuntimeError), prepare(role_dir, OPTIONS) as prepared:
        with staged_output(tmp_path / "out", source=role_dir, overwrite=False) as staging:
            write_side_files(prepared, staging, OPTIONS)
            pid = the_worker()
            raise RuntimeError("the writing failed")  # staged_output removes the staging folder

    deadline = time.monotonic() + 120  # its imports first (seconds on a loaded machine), then it looks
    while state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert state(pid) == "Z"  # exited by itself; the next merge's start reaps it
