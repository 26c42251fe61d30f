"""A store that fails for a moment, or for good, on the real SeaweedFS behind a fault-injecting proxy
(``fault_proxy``): what the library retries, what the merge retries or recognises itself, and the one line
left when the store stays down. Conditional writes are never weakened: a 412 is an answer, not a fault."""

from __future__ import annotations

import logging
import time

import pytest

from merge_pipeline.store import lock as store_lock
from merge_pipeline.store.lock import LOCK_SUFFIX, locked_store_target
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import assert_bit_exact, error_lines, merge
from merge_pipeline_tests.object_store import download, upload

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("fault", ["500", "reset", "lost answer"])
def test_a_lock_write_that_fails_once_is_retried_and_the_merge_succeeds(
    capsys, bucket, faulty_store, fsdp_checkpoint, tmp_path, fault
):
    """ "lost answer": the lock was created, its answer never came; the retried ``If-None-Match`` PUT is
    refused (412) and the lock found to hold this merge's own token, not another merge's."""
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    source, target = upload(fs, sample.role_dir, f"{b}/ckpt/actor"), f"s3://{b}/merged"
    injected = faulty_store.fail("PUT", f"/{b}/merged{LOCK_SUFFIX}", fault)

    code, _, err = merge(capsys, source, target)

    assert code == 0, err
    assert injected.hits == 1
    assert_bit_exact(download(fs, target, tmp_path / "merged"), sample.reference_dir)
    assert not fs.exists(f"{b}/merged{LOCK_SUFFIX}")


def test_a_refresh_the_store_failed_is_tried_again_and_the_lock_stays_held(bucket, faulty_store, monkeypatch, caplog):
    """Before: any error of a refresh marked the lock lost, and the merge refused to publish."""
    fs, b = bucket
    monkeypatch.setattr(store_lock, "REFRESH_SECONDS", 0.1)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    caplog.set_level(logging.WARNING, logger="merge_pipeline")
    with locked_store_target(f"s3://{b}/merged") as lock:
        down = faulty_store.fail("PUT", f"/{b}/merged{LOCK_SUFFIX}", "500", times=4)  # two refreshes, both tries
        deadline = time.monotonic() + 60
        while down.hits < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # refreshed again since
        assert not lock.lost
        lock.confirm()
    assert "merged.merge_lock: not refreshed (" in caplog.text and "trying again" in caplog.text
    assert not fs.exists(f"{b}/merged{LOCK_SUFFIX}"), "released by its holder"


def test_a_weight_read_cut_half_way_is_read_again(capsys, bucket, faulty_store, fsdp_checkpoint, tmp_path):
    """A ranged GET whose answer is cut after its head: the library retried the request, not its body."""
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    source, target = upload(fs, sample.role_dir, f"{b}/ckpt/actor"), f"s3://{b}/merged"
    injected = faulty_store.fail("GET", f"/{b}/ckpt/actor/model_world_size_2_rank_1.pt", "cut answer", times=2)

    code, _, err = merge(capsys, source, target)

    assert code == 0, err
    assert injected.hits == 2
    assert_bit_exact(download(fs, target, tmp_path / "merged"), sample.reference_dir)


def test_a_store_down_for_good_is_one_line_naming_the_url_after_the_retries(
    capsys, bucket, faulty_store, fsdp_checkpoint, monkeypatch
):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    source, target = upload(fs, sample.role_dir, f"{b}/ckpt/actor"), f"s3://{b}/merged"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")  # botocore's own setting: three tries of each request
    for method in ("GET", "HEAD", "PUT", "POST", "DELETE"):
        faulty_store.fail(method, "/", "500", times=None)

    started = time.monotonic()
    code, _, err = merge(capsys, source, target)

    assert code == 1 and len(error_lines(err)) == 1, err
    assert f"s3://{b}/" in err and "the store did not answer after retries (" in err, err
    assert "Internal Server Error" in err or "internal error" in err, err  # the store's words
    requests = len(faulty_store.requests)
    assert requests >= 3, faulty_store.requests
    print(f"store down: one line after {requests} requests, {time.monotonic() - started:.1f} s: {err.strip()}")
    assert not fs.exists(f"{b}/merged")
