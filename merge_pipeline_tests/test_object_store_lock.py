"""One merge at a time into a target in a store, across machines: the lock object beside the prefix, on the
real SeaweedFS of ``test_object_store``. "Another machine" is another holder of the same lock through its
API, as another host's merge takes it, or a holder's record written as another pod's merge writes it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.store import lock as store_lock
from merge_pipeline.store import published_prefix
from merge_pipeline.store.lock import LOCK_SUFFIX, locked_store_target
from merge_pipeline.store.object_upload import upload_file
from merge_pipeline.store.url import location
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import assert_bit_exact, error_lines, merge
from merge_pipeline_tests.object_store import download, upload

pytestmark = pytest.mark.slow


def record_here(pid: int) -> dict:
    """A lock holder's record naming ``pid`` in this process's host, kernel (boot id) and PID namespace."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"host": socket.gethostname(), "pid": pid, "boot": boot, "pid_ns": os.stat("/proc/self/ns/pid").st_ino}


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
        record = {"host": host, "pid": pid}
    else:
        killed = subprocess.Popen([sys.executable, "-c", "pass"])
        killed.wait()
        host, pid = socket.gethostname(), killed.pid
        record = record_here(pid)
    fs.pipe(f"{b}/merged{LOCK_SUFFIX}", json.dumps({**record, "token": "gone"}).encode())
    time.sleep(1.5 if where == "another machine" else 0)  # the killed merge refreshes it no more

    caplog.set_level(logging.WARNING, logger="merge_pipeline")
    code, _, err = merge(capsys, source, target)

    assert code == 0, err
    assert f"took over the lock of a merge (host {host}, pid {pid})" in caplog.text
    assert_bit_exact(download(fs, target, tmp_path / "merged"), sample.reference_dir)


def test_a_holder_whose_lock_was_taken_over_finds_out_at_its_next_step(bucket, monkeypatch):
    """Asked of the store at each step, not remembered from the last refresh (30 s apart)."""
    fs, b = bucket
    monkeypatch.setattr(store_lock, "REFRESH_SECONDS", 0.2)
    with locked_store_target(f"s3://{b}/merged") as lock:
        lock.confirm()
        time.sleep(0.5)
        lock.confirm()  # refreshed, still ours
        fs.pipe(f"{b}/merged{LOCK_SUFFIX}", b'{"host": "node-8", "pid": 1, "token": "theirs"}')  # taken over
        with pytest.raises(MergeError, match=r"lock .*merged\.merge_lock was taken over by another merge"):
            lock.confirm()
    assert fs.cat(f"{b}/merged{LOCK_SUFFIX}") == b'{"host": "node-8", "pid": 1, "token": "theirs"}'  # theirs stays


@pytest.mark.parametrize("where", ["another PID namespace", "another machine of the same host name"])
def test_a_dead_pid_of_this_host_name_elsewhere_is_no_gone_holder(capsys, bucket, fsdp_checkpoint, where):
    """Two pods with host networking share a host name, not their pids: a pid not alive here may be
    a merge running there; its lock is kept until its lease runs out."""
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    source, target = upload(fs, sample.role_dir, f"{b}/ckpt/actor"), f"s3://{b}/merged"
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()
    record = {**record_here(killed.pid), "token": "theirs"}
    if where == "another PID namespace":
        record["pid_ns"] += 1
    else:
        record["boot"] = "0" * 8 + record["boot"][8:]
    fs.pipe(f"{b}/merged{LOCK_SUFFIX}", json.dumps(record).encode())

    code, _, err = merge(capsys, source, target)

    assert code == 1 and len(error_lines(err)) == 1, err
    assert f"another merge (host {socket.gethostname()}, pid {killed.pid}) is writing this target" in err, err
    assert json.loads(fs.cat(f"{b}/merged{LOCK_SUFFIX}"))["token"] == "theirs"
    assert not fs.exists(f"{b}/merged")


def test_a_superseded_holder_stops_at_its_next_upload_and_leaves_the_new_merge_intact(
    capsys, bucket, fsdp_checkpoint, monkeypatch
):
    """A merge stalled past its lease is taken over, and the new holder publishes (bfloat16) while the old
    one (float32) still has weight files to upload: the old one stops at its next upload, in one line,
    deleting and overwriting nothing; the new manifest describes every object (their sha256)."""
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    source, target = upload(fs, sample.role_dir, f"{b}/ckpt/actor"), f"s3://{b}/merged"
    code, _, err = merge(capsys, source, f"s3://{b}/newer", "--dtype", "bfloat16", "--max-shard-size", "60000")
    assert code == 0, err
    newer = sorted(fs.find(f"{b}/newer"))
    monkeypatch.setenv("MERGE_PIPELINE_PARALLEL_UPLOADS", "1")  # one upload at a time: the takeover falls between two
    real_upload, uploads = published_prefix.upload_file, []

    def upload_then_taken_over(store, folder, relative, *args, **kwargs):
        real_upload(store, folder, relative, *args, **kwargs)
        uploads.append(relative)
        if len(uploads) == 1:  # the new holder takes the lock over and publishes its merge
            fs.pipe(f"{b}/merged{LOCK_SUFFIX}", b'{"host": "node-8", "pid": 1, "token": "theirs"}')
            fs.copy(newer, [k.replace(f"{b}/newer/", f"{b}/merged/") for k in newer])

    monkeypatch.setattr(published_prefix, "upload_file", upload_then_taken_over)
    code, _, err = merge(capsys, source, target, "--dtype", "float32", "--max-shard-size", "60000")

    assert code == 1 and len(error_lines(err)) == 1, err
    assert "merged.merge_lock was taken over by another merge" in err and "stopped before its next upload" in err
    assert len(uploads) == 1, uploads
    published = json.loads(fs.cat(f"{b}/merged/merge_manifest.json"))
    left = {f"{b}/merged/{uploads[0]}"}  # its one upload, named by no manifest: left, never a guess deleted
    assert set(fs.find(f"{b}/merged")) == {k.replace(f"{b}/newer/", f"{b}/merged/") for k in newer} | left
    assert uploads[0] not in published["files"]
    for name, described in published["files"].items():
        assert hashlib.sha256(fs.cat(f"{b}/merged/{name}")).hexdigest() == described["sha256"], name
    assert json.loads(fs.cat(f"{b}/merged/config.json"))["dtype"] == "bfloat16"
    assert json.loads(fs.cat(f"{b}/merged{LOCK_SUFFIX}"))["token"] == "theirs"


def test_a_multipart_upload_is_confirmed_again_before_it_is_completed(bucket, tmp_path, monkeypatch):
    """Its parts take long and are no object until completed: a lock lost meanwhile completes nothing, and
    the parts are aborted; confirmed twice, it is the file, with its sha256 as metadata."""
    fs, b = bucket
    monkeypatch.setenv("MERGE_PIPELINE_PART_BYTES", "5MiB")  # S3's smallest part: three parts
    data = os.urandom(11 << 20)
    (tmp_path / "model.safetensors").write_bytes(data)
    store, confirmed = location(f"s3://{b}/merged"), []

    def lost_after_the_parts() -> None:
        confirmed.append("lost")
        if len(confirmed) == 2:
            raise MergeError(None, "lost")

    with pytest.raises(MergeError, match="lost"):
        upload_file(store, tmp_path, "model.safetensors", "ab" * 32, lost_after_the_parts)
    assert len(confirmed) == 2 and not fs.exists(f"{b}/merged/model.safetensors")
    assert not fs.call_s3("list_multipart_uploads", Bucket=b).get("Uploads"), "its parts aborted"

    upload_file(store, tmp_path, "model.safetensors", "ab" * 32, published_prefix.unguarded)
    assert fs.cat(f"{b}/merged/model.safetensors") == data
    assert fs.metadata(f"{b}/merged/model.safetensors", refresh=True)["sha256"] == "ab" * 32
