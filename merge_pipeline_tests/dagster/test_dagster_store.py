"""``new_checkpoint_sensor`` and the merge step over checkpoint roots and an output root in object storage
on the real S3 server of ``object_store.py``: the listing in bounded pages, completeness from
the readers' markers and the objects' modification times, a step merged from the bucket into the bucket
bit for bit, a step deleted before its run, and the one-line refusals (wrong credentials, no bucket).
"""

from __future__ import annotations

import time

import dagster as dg
import pytest

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.dagster.sensors import SOURCE_TAG
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.watch.cursor import cursor_keys
from merge_pipeline.watch.location_settings import CHECKPOINT_ROOTS
from merge_pipeline_tests.dagster.helpers import ACTOR, asset, materialize
from merge_pipeline_tests.dagster.test_dagster_sensor import requested, tick
from merge_pipeline_tests.dagster.test_sensor_stacks import DEEPSPEED, DEEPSPEED_DONE
from merge_pipeline_tests.helpers import assert_bit_exact
from merge_pipeline_tests.object_store import SECRET_KEY

KEY = "run/global_step_1/actor"


def test_the_roots_variable_keeps_a_urls_colon(monkeypatch, tmp_path):
    monkeypatch.setenv("MERGE_PIPELINE_CHECKPOINT_ROOTS", f"s3://b/ckpts:{tmp_path}:gs://c/d")
    assert MergeSettings().value(CHECKPOINT_ROOTS) == ["s3://b/ckpts", tmp_path, "gs://c/d"]


def put_step(fs, bucket: str, sample, key: str, *, tracker: int | None = None) -> str:
    """A verl step uploaded as a trainer's copy to the bucket would: the role folder, then the tracker."""
    run, step_dir, role = key.split("/")
    url_path = f"{bucket}/ckpts/{run}/{step_dir}/{role}"
    fs.put(str(sample.role_dir) + "/", url_path + "/", recursive=True)
    if tracker is not None:
        fs.pipe(f"{bucket}/ckpts/{run}/{TRACKER}", str(tracker).encode())
    return f"s3://{url_path}"


def store_settings(bucket: str, settle_seconds: float = 3600) -> MergeSettings:
    return MergeSettings(
        checkpoint_roots=[f"s3://{bucket}/ckpts"], output_root=f"s3://{bucket}/merged", settle_seconds=settle_seconds
    )


def skip_message(result: dg.SensorResult) -> str:
    return result.skip_reason.skip_message


@pytest.mark.slow
def test_the_sensor_lists_a_store_root_in_pages_and_asks_the_tracker(
    bucket, fsdp_checkpoint, instance, monkeypatch, record_property
):
    fs, b = bucket
    sample = fsdp_checkpoint(ACTOR)
    for step in (1, 2, 3):  # more folders than one page of keys holds
        put_step(fs, b, sample, f"run/global_step_{step}/actor")
    monkeypatch.setenv("MERGE_PIPELINE_LIST_PAGE_KEYS", "2")
    settings = store_settings(b)

    waiting = tick(instance, settings)
    assert requested(waiting) == []
    assert skip_message(waiting).startswith(
        f"waiting for 3 partial checkpoint(s): {KEY} (no {TRACKER}; a file changed"
    ), skip_message(waiting)

    fs.pipe(f"{b}/ckpts/run/{TRACKER}", b"2")  # the trainer's tracker: steps 1 and 2 are complete
    started = time.monotonic()
    result = tick(instance, settings, waiting.cursor)
    seconds = time.monotonic() - started
    assert requested(result) == ["run/global_step_1/actor", "run/global_step_2/actor"]
    assert [r.tags[SOURCE_TAG] for r in result.run_requests] == [
        f"s3://{b}/ckpts/run/global_step_{s}/actor" for s in (1, 2)
    ]
    assert result.asset_events[0].metadata["completeness"].value == f"{TRACKER} says 2 >= 1"
    record_property("store_sensor_tick_seconds", round(seconds, 2))
    print(f"sensor tick over the store root (3 steps, pages of 2 keys): {seconds:.2f} s")

    again = tick(instance, settings, result.cursor)  # known steps: not asked again
    assert requested(again) == [] and sorted(cursor_keys(again.cursor)) == requested(result)


@pytest.mark.slow
def test_without_a_marker_the_objects_modification_times_settle_a_step(bucket, fsdp_checkpoint, instance):
    fs, b = bucket
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY)
    settings = store_settings(b, settle_seconds=3)

    first = tick(instance, settings)
    assert requested(first) == [] and "settle time 3 s" in skip_message(first), skip_message(first)
    time.sleep(4)
    settled = tick(instance, settings, first.cursor)
    assert requested(settled) == [KEY]
    assert "no file changed for" in settled.asset_events[0].metadata["completeness"].value


@pytest.mark.slow
def test_a_deepspeed_save_in_the_bucket_is_complete_by_its_model_states_not_the_settle_time(
    bucket, deepspeed_checkpoints, instance
):
    """DeepSpeed's rule reads the data-parallel world size from the model states' pickle: in a store, a few
    ranged GETs of that object, and no settle time to wait once ``latest`` names the tag."""
    fs, b = bucket
    save_dir, prefix = deepspeed_checkpoints[DEEPSPEED][0], f"{b}/ckpts/ds/ckpt"
    late = "global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    for path in sorted(p for p in save_dir.rglob("*") if p.is_file() and p.name != "latest"):
        if path.relative_to(save_dir).as_posix() != late:
            fs.put_file(str(path), f"{prefix}/{path.relative_to(save_dir).as_posix()}")

    def save_latest() -> None:
        time.sleep(1.1)  # after the tag's objects: LastModified counts whole seconds
        fs.pipe_file(f"{prefix}/latest", (save_dir / "latest").read_bytes())

    save_latest()
    settings, key = store_settings(b), "ds/ckpt/global_step2"
    waiting = tick(instance, settings)
    assert requested(waiting) == []
    assert f"{key} (DeepSpeed: latest names this tag, but 1 rank file(s) missing: " in skip_message(waiting)

    fs.put_file(str(save_dir / late), f"{prefix}/{late}")
    save_latest()
    result = tick(instance, settings, waiting.cursor)
    assert requested(result) == [key]
    assert result.asset_events[0].metadata["completeness"].value == DEEPSPEED_DONE


@pytest.mark.slow
def test_a_step_merged_from_the_bucket_into_the_bucket_is_bit_exact_and_recorded_as_merged(
    bucket, fsdp_checkpoint, instance, tmp_path, record_property
):
    fs, b = bucket
    sample = fsdp_checkpoint(ACTOR)
    put_step(fs, b, sample, KEY, tracker=1)
    settings = store_settings(b)

    started = time.monotonic()
    result = materialize(instance, settings, KEY)
    seconds = time.monotonic() - started
    assert result.success, result.all_events
    target = f"{b}/merged/{KEY}"
    assert fs.isfile(f"{target}/merge_manifest.json")
    fs.get(target + "/", str(tmp_path / "merged") + "/", recursive=True)
    assert_bit_exact(tmp_path / "merged", sample.reference_dir)
    [published] = [e for e in result.get_asset_materialization_events() if e.asset_key.path == ["hf_model"]]
    metadata = published.materialization.metadata
    assert metadata["path"].value == f"s3://{target}" and metadata["source"].value == f"s3://{b}/ckpts/{KEY}"
    record_property("store_to_store_merge_seconds", round(seconds, 2))
    print(f"the merge step, store -> store (FSDP world size 2): {seconds:.1f} s")

    fresh = tick(instance, settings)  # merged before: remembered, never requested
    assert requested(fresh) == [] and KEY in cursor_keys(fresh.cursor)


@pytest.mark.slow
def test_a_step_deleted_before_its_run_fails_it_in_one_line(bucket, fsdp_checkpoint, instance):
    fs, b = bucket
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY, tracker=1)
    settings = store_settings(b)
    assert requested(tick(instance, settings)) == [KEY]
    fs.rm(f"{b}/ckpts/run/global_step_1", recursive=True)  # the trainer's rotation, before the run starts

    result = materialize(instance, settings, KEY)
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message.strip()
    assert "\n" not in message
    assert f"s3://{b}/ckpts/{KEY}: no such checkpoint folder under the checkpoint roots" in message, message
    assert not fs.exists(f"{b}/merged/{KEY}")


@pytest.mark.slow
def test_wrong_credentials_and_a_missing_bucket_are_one_line_without_the_secret(
    bucket, fsdp_checkpoint, instance, monkeypatch
):
    fs, b = bucket
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY, tracker=1)
    missing = MergeSettings(checkpoint_roots=["s3://no-such-bucket-36/ckpts"], output_root=f"s3://{b}/merged")
    reason = skip_message(tick(instance, missing))
    assert reason.startswith("not watched: s3://no-such-bucket-36/ckpts: the bucket does not exist"), reason

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + SECRET_KEY)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    reason = skip_message(tick(instance, store_settings(b)))
    assert reason.startswith(f"not watched: s3://{b}/ckpts: access denied"), reason
    assert SECRET_KEY not in reason and "\n" not in reason


@pytest.mark.slow
def test_the_step_report_reads_merged_steps_in_the_bucket(bucket, fsdp_checkpoint, instance):
    fs, b = bucket
    settings = store_settings(b)
    for step in (1, 2):  # the same weights saved twice: the report must find them bit-identical
        key = f"run/global_step_{step}/actor"
        put_step(fs, b, fsdp_checkpoint(ACTOR), key, tracker=step)
        assert materialize(instance, settings, key).success

    result = materialize(instance, settings, "run/global_step_2/actor", selection=[asset("step_report")])

    assert result.success, result.all_events
    [event] = result.get_asset_materialization_events()
    metadata = event.materialization.metadata
    assert metadata["path"].value == f"s3://{b}/merged/run/global_step_2/actor"
    assert metadata["previous step"].value == f"s3://{b}/merged/run/global_step_1/actor"
    assert metadata["largest change vs previous step"].value == 0.0 and metadata["NaN"].value == 0
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {"finite": True, "weights_changed": False}


@pytest.mark.slow
def test_a_step_deleted_mid_merge_fails_its_run_in_one_line(bucket, fsdp_checkpoint, instance, monkeypatch):
    fs, b = bucket
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY, tracker=1)
    settings = store_settings(b)
    from merge_pipeline.pipeline import merge as merge_sequence

    original = merge_sequence.write_side_files

    def rotated_meanwhile(*args, **kwargs):  # the trainer's rotation deletes the step after it was planned
        fs.rm(f"{b}/ckpts/run/global_step_1", recursive=True)
        return original(*args, **kwargs)

    monkeypatch.setattr(merge_sequence, "write_side_files", rotated_meanwhile)
    result = materialize(instance, settings, KEY)

    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message.strip()
    assert "\n" not in message
    assert f"s3://{b}/ckpts/{KEY}/" in message and ": deleted while it was being merged" in message, message
    assert not fs.exists(f"{b}/merged/{KEY}/merge_manifest.json")


@pytest.mark.slow
def test_a_run_the_store_failed_is_retried_by_the_instance_one_a_bad_checkpoint_failed_is_not(
    bucket, faulty_store, fsdp_checkpoint, instance, monkeypatch
):
    """The instance retries no step failure (``retry_on_asset_or_op_failure: false``) but a store that did
    not answer after the library's retries: Dagster's own decision, its run tag ``dagster/will_retry``."""
    fs, b = bucket
    settings = store_settings(b)
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY, tracker=1)
    bad = "run/global_step_2/actor"
    put_step(fs, b, fsdp_checkpoint(ACTOR), bad, tracker=2)
    fs.pipe(f"{b}/ckpts/{bad}/model_world_size_2_rank_1.pt", b"a crash mid-write")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    faulty_store.fail("PUT", f"/{b}/merged/", "500", times=None)  # every write into the output root fails
    started = time.monotonic()
    down = materialize(instance, settings, KEY)
    print(f"store down: the run failed after {time.monotonic() - started:.1f} s, {len(faulty_store.requests)} requests")
    faulty_store.faults.clear()  # the store is back
    broken = materialize(instance, settings, bad)

    assert not down.success and not broken.success
    runs = {name: instance.get_run_by_id(r.run_id) for name, r in (("down", down), ("broken", broken))}
    assert {name: run.tags.get("dagster/will_retry") for name, run in runs.items()} == {
        "down": "true",
        "broken": "false",
    }
