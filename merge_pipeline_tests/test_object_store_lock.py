"""One merge at a time into a target in a store, across machines: the lock object beside the
prefix, on the real SeaweedFS of ``test_object_store``. "Another machine" is another holder of the same
lock through its API, as another host's merge takes it."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time

import pytest

from merge_pipeline import store_lock
from merge_pipeline.errors import MergeError
from merge_pipeline.store_lock import LOCK_SUFFIX, locked_store_target
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import assert_bit_exact, error_lines, merge
from merge_pipeline_tests.object_store import download, upload

pytestmark = pytest.mark.slow


def test_a_merge_into_a_target_another_machine_merges_into_is_one_line_and_uploads_nothing(
    capsys,
    bucket,
    fsdp_checkpoint,
    tmp_path,
):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    source, target = upload(fs, sample.role_dir, f"{b}/ckpt/actor"), f"s3://{b}/merged"

    with locked_store_target(target):
        code, _, err = merge(capsys, source, target)
        assert code == 1 and len(error_lines(err)) == 1, err
        assert "another merge (host " in err and "is writing this target right now" in err, err
        assert not fs.exists(f"{b}/merged"), "nothing uploaded while the other merge holds the target"

    assert not fs.exists(f"{b}/merged{LOCK_SUFFIX}"), "its holder removed the lock"
    code, _, err = merge(capsys, source, target)
    assert code == 0, err
    assert_bit_exact(download(fs, target, tmp_path / "merged"), sample.reference_dir)
    assert not fs.exists(f"{b}/merged{LOCK_SUFFIX}")


@pytest.mark.parametrize("where", ["another machine", "this machine"])
def test_the_lock_of_a_killed_merge_is_taken_over(
    capsys,
    caplog,
    bucket,
    fsdp_checkpoint,
    tmp_path,
    monkeypatch,
    where,
):
    """Another machine's once its lease ran out; this machine's as soon as its process is gone."""
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    source, target = upload(fs, sample.role_dir, f"{b}/ckpt/actor"), f"s3://{b}/merged"
    if where == "another machine":
        host, pid = "node-7", 4242
        monkeypatch.setattr(store_lock, "LEASE_SECONDS", 1.0)
    else:
        killed = subprocess.Popen([sys.executable, "-c", "pass"])
        killed.wait()
        host, pid = socket.gethostname(), killed.pid
    fs.pipe(f"{b}/merged{LOCK_SUFFIX}", json.dumps({"host": host, "pid": pid, "token": "gone"}).encode())
    time.sleep(1.5 if where == "another machine" else 0)  # the killed merge refreshes it no more

    caplog.set_level(logging.WARNING, logger="merge_pipeline")
    code, _, err = merge(capsys, source, target)

    assert code == 0, err
    assert f"took over the lock of a merge (host {host}, pid {pid})" in caplog.text
    assert_bit_exact(download(fs, target, tmp_path / "merged"), sample.reference_dir)


def test_a_holder_whose_lock_was_taken_over_finds_out_before_it_commits(bucket, monkeypatch):
    fs, b = bucket
    monkeypatch.setattr(store_lock, "REFRESH_SECONDS", 0.2)
    with locked_store_target(f"s3://{b}/merged") as lock:
        lock.check()  # refreshed, still ours
        time.sleep(0.5)
        lock.check()
        fs.pipe(f"{b}/merged{LOCK_SUFFIX}", b'{"host": "node-8", "pid": 1, "token": "theirs"}')  # taken over
        time.sleep(0.5)
        with pytest.raises(MergeError, match=r"lock .*merged\.merge_lock was lost while merging"):
            lock.check()
    assert fs.cat(f"{b}/merged{LOCK_SUFFIX}") == b'{"host": "node-8", "pid": 1, "token": "theirs"}'  # theirs stays
