"""``new_checkpoint_sensor`` over real FSDP checkpoint folders: complete vs partial, idempotent, rotation-proof."""

from __future__ import annotations

import json
import os
import shutil
import time

import dagster as dg
import pytest

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.dagster.sensors import SOURCE_TAG
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.pipeline.merge import merge
from merge_pipeline.watch.cursor import cursor_keys
from merge_pipeline.watch.discovery import completeness
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_tests.dagster.helpers import ACTOR, CRITIC, LOCATION, materialize
from merge_pipeline_tests.helpers import tree_digest

new_checkpoint_sensor = LOCATION.resolve_sensor_def("new_checkpoint_sensor")


def tick(instance, settings, cursor=None) -> dg.SensorResult:
    return new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=cursor, resources={"settings": settings})
    )


def requested(result: dg.SensorResult) -> list[str]:
    return [r.partition_key for r in result.run_requests or []]


def age(folder, seconds: float) -> None:
    """Make every file and folder under ``folder`` look last changed ``seconds`` ago."""
    then = time.time() - seconds
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (then, then))


def test_complete_roles_get_one_run_and_one_partition_each(fsdp_checkpoint, roots, instance):
    actor = roots.drop(fsdp_checkpoint(ACTOR), "proj/exp/global_step_5")
    critic = roots.drop(fsdp_checkpoint(CRITIC), "proj/exp/global_step_5", tracker=5)

    result = tick(instance, roots.settings())

    keys = ["proj/exp/global_step_5/actor", "proj/exp/global_step_5/critic"]
    assert requested(result) == keys
    assert [r.tags[SOURCE_TAG] for r in result.run_requests] == [str(actor), str(critic)]
    [added] = result.dynamic_partitions_requests
    assert (added.partitions_def_name, list(added.partition_keys)) == ("checkpoints", keys)
    assert sorted(cursor_keys(result.cursor)) == keys
    # each saved checkpoint recorded as the external asset's event, with where it is and why it counts as complete
    assert [(e.asset_key.to_user_string(), e.partition) for e in result.asset_events] == [
        ("checkpoint", k) for k in keys
    ]
    assert [e.metadata["path"].value for e in result.asset_events] == [str(actor), str(critic)]
    assert result.asset_events[1].metadata["completeness"].value == "latest_checkpointed_iteration.txt says 5 >= 5"
    # one run per step and save: the run key is the partition key at the step's newest change
    assert [r.run_key for r in result.run_requests] == [
        f"{k}@{e.metadata['written_at'].value}" for k, e in zip(keys, result.asset_events, strict=True)
    ]


def test_partial_checkpoint_waits_until_the_trainer_says_it_is_done(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_6", tracker=5)  # tracker still at the previous step
    settings = roots.settings(settle_seconds=3600)

    waiting = tick(instance, settings)
    assert requested(waiting) == [] and waiting.dynamic_partitions_requests == []
    assert waiting.skip_reason.skip_message.startswith(
        "waiting for 1 partial checkpoint(s): run/global_step_6/actor (latest_checkpointed_iteration.txt says 5; a file changed"
    )

    (roots.checkpoints / "run" / TRACKER).write_text("6")
    assert requested(tick(instance, settings, waiting.cursor)) == ["run/global_step_6/actor"]


def test_an_earlier_runs_tracker_does_not_skip_the_settle_time(fsdp_checkpoint, roots, instance):
    tracker = roots.checkpoints / "run" / TRACKER
    tracker.parent.mkdir()
    tracker.write_text("5")  # an earlier run's, still there when the new run saves step 3
    age(tracker, 600)
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_3")
    settings = roots.settings(settle_seconds=60)

    waiting = tick(instance, settings)

    assert requested(waiting) == []
    assert waiting.skip_reason.skip_message.startswith(
        f"waiting for 1 partial checkpoint(s): run/global_step_3/actor ({TRACKER} says 5 >= 3, but was written before the step's last change (an earlier run's?); a file changed"
    )
    age(role_dir, 61)
    assert requested(tick(instance, settings, waiting.cursor)) == ["run/global_step_3/actor"]


def test_without_tracker_a_checkpoint_is_complete_once_settled(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1")
    settings = roots.settings(settle_seconds=60)
    assert requested(tick(instance, settings)) == []  # just written

    age(role_dir, 30)
    assert requested(tick(instance, settings)) == []
    assert not completeness(role_dir, 1, 60).complete

    age(role_dir, 61)
    assert requested(tick(instance, settings)) == ["run/global_step_1/actor"]


def test_repeated_ticks_request_each_checkpoint_once(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1)
    settings = roots.settings()

    first = tick(instance, settings)
    second = tick(instance, settings, first.cursor)
    third = tick(instance, settings, second.cursor)

    assert requested(first) == ["run/global_step_1/actor"]
    assert requested(second) == requested(third) == [] and cursor_keys(third.cursor) == cursor_keys(first.cursor)
    assert third.skip_reason.skip_message == "no new checkpoints (1 known)"
    # A lost cursor asks again, under the same run key: Dagster launches a run key only once.
    assert [r.run_key for r in tick(instance, settings).run_requests] == [r.run_key for r in first.run_requests]


def test_folders_deleted_by_rotation_leave_the_cursor(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    for step in (1, 2, 3):
        roots.drop(sample, f"run/global_step_{step}", tracker=step, link=True)
    settings = roots.settings()
    first = tick(instance, settings)
    assert len(requested(first)) == 3

    shutil.rmtree(roots.checkpoints / "run" / "global_step_1")
    shutil.rmtree(roots.checkpoints / "run" / "global_step_2" / "actor")
    after = tick(instance, settings, first.cursor)

    assert requested(after) == [] and sorted(cursor_keys(after.cursor)) == ["run/global_step_3/actor"]
    shutil.rmtree(roots.checkpoints)  # the whole root gone: nothing to do, no error
    assert sorted(cursor_keys(tick(instance, settings, after.cursor).cursor)) == []


def test_hundreds_of_steps_cost_one_cheap_scan(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    for step in range(1, 301):
        roots.drop(sample, f"run/global_step_{step}", link=True)
    (roots.checkpoints / "run" / TRACKER).write_text("300")
    settings = roots.settings()

    first = tick(instance, settings)
    started = time.monotonic()
    second = tick(instance, settings, first.cursor)
    seconds = time.monotonic() - started

    assert len(requested(first)) == 300 and len(set(r.run_key for r in first.run_requests)) == 300
    assert requested(second) == [] and len(cursor_keys(second.cursor)) == 300
    assert seconds < 2, f"a tick over 300 known steps took {seconds:.2f} s"


def test_steps_already_merged_are_skipped(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    merged_by_hand = roots.drop(sample, "run/global_step_1", link=True)
    roots.drop(sample, "run/global_step_2", tracker=2, link=True)
    merge(merged_by_hand, roots.target("run/global_step_1/actor"), show_progress=False)

    result = tick(instance, roots.settings())

    assert requested(result) == ["run/global_step_2/actor"]
    assert sorted(cursor_keys(result.cursor)) == ["run/global_step_1/actor", "run/global_step_2/actor"]
    # a fresh instance shows the step merged before as materialized, marked as found
    [added] = result.dynamic_partitions_requests
    assert sorted(added.partition_keys) == ["run/global_step_1/actor", "run/global_step_2/actor"]
    found = [e for e in result.asset_events if e.asset_key == dg.AssetKey("hf_model")]
    assert [(e.partition, e.metadata["found"].value) for e in found] == [("run/global_step_1/actor", True)]
    instance.add_dynamic_partitions("checkpoints", list(added.partition_keys))
    again = tick(instance, roots.settings())  # lost cursor: the known partition is not recorded twice
    assert not [e for e in again.asset_events or [] if e.asset_key == dg.AssetKey("hf_model")]


def test_finds_steps_up_to_three_levels_deep_and_maps_keys_back(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    for step_dir in [
        "global_step_1",
        "a/global_step_1",
        "a/b/global_step_1",
        "a/b/c/global_step_1",
        ".trash/global_step_1",
        "merged/x/global_step_1",
    ]:
        roots.drop(sample, step_dir, link=True)
        (roots.checkpoints / step_dir).parent.joinpath(TRACKER).write_text("1")
    settings = MergeSettings(checkpoint_roots=[str(roots.checkpoints)], output_root=str(roots.checkpoints / "merged"))

    keys = requested(tick(instance, settings))

    assert keys == ["checkpoints/global_step_1/actor", "a/global_step_1/actor", "a/b/global_step_1/actor"]
    for key in keys:
        assert settings.role_dir(checkpoint_key(key)) == roots.checkpoints / key.removeprefix("checkpoints/")


@pytest.mark.parametrize(
    "key",
    [
        "global_step_1/actor",
        "run/global_step_x/actor",
        "run/global_step_1/reward",
        "../run/global_step_1/actor",
        "/abs/global_step_1/actor",
        "a//b/global_step_1/actor",
    ],
)
def test_malformed_partition_keys_are_refused(key):
    with pytest.raises(MergeError, match="is not <run_name>/global_step_<N>/<actor|critic>"):
        checkpoint_key(key)


def test_rotation_removes_unmerged_partitions_and_never_merged_outputs(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    for step in (1, 2, 3):
        roots.drop(sample, f"run/global_step_{step}", tracker=step, link=True)
    settings = roots.settings()
    first = tick(instance, settings)
    instance.add_dynamic_partitions("checkpoints", requested(first))
    merge(roots.checkpoints / "run/global_step_1/actor", roots.target("run/global_step_1/actor"), show_progress=False)
    merged = tree_digest(roots.target("run/global_step_1/actor"))
    shutil.rmtree(roots.checkpoints / "run" / "global_step_1")  # merged, then rotated away
    shutil.rmtree(roots.checkpoints / "run" / "global_step_2")  # rotated away before its merge

    after = tick(instance, settings, first.cursor)

    [removed] = after.dynamic_partitions_requests
    assert isinstance(removed, dg.DeleteDynamicPartitionsRequest) and list(removed.partition_keys) == [
        "run/global_step_2/actor"
    ]
    assert tree_digest(roots.target("run/global_step_1/actor")) == merged
    # an unreadable root proves nothing: no partition is removed while it cannot be read
    shutil.rmtree(roots.checkpoints)
    assert tick(instance, settings, after.cursor).dynamic_partitions_requests == []


def test_skip_reason_lists_partitions_whose_last_merge_failed(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1")
    rank_file = role_dir / "model_world_size_2_rank_0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    roots.track(role_dir, 1)  # the trainer's word, after the (broken) save
    settings = roots.settings()
    first = tick(instance, settings)
    assert requested(first) == ["run/global_step_1/actor"]
    assert not materialize(instance, settings, "run/global_step_1/actor").success

    reason = tick(instance, settings, first.cursor).skip_reason.skip_message

    assert (
        reason
        == "no new checkpoints (1 known) | last merge failed for 1: run/global_step_1/actor (see Runs; re-execute or backfill them)"
    )


def test_a_failed_merge_is_requested_again_once_the_step_changes(fsdp_checkpoint, roots, instance):
    """A save that paused longer than the settle time: the too-early merge fails; the finished save is merged."""
    sample = fsdp_checkpoint(ACTOR)
    role_dir = roots.drop(sample, "run/global_step_1")  # no tracker: the settle time decides
    rank_file = role_dir / "model_world_size_2_rank_1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])  # half written when the save paused
    age(role_dir, 120)
    settings, key = roots.settings(settle_seconds=60), "run/global_step_1/actor"
    first = tick(instance, settings)
    [request] = first.run_requests
    daemon_tags = {"dagster/run_key": request.run_key, "dagster/sensor_name": "new_checkpoint_sensor"}
    assert not materialize(instance, settings, key, tags=daemon_tags).success  # the run the daemon launched

    unchanged = tick(instance, settings, first.cursor)
    assert requested(unchanged) == []  # the same save would fail the same way
    assert "| last merge failed for 1: run/global_step_1/actor" in unchanged.skip_reason.skip_message

    shutil.copy(sample.role_dir / rank_file.name, rank_file)  # the save goes on and finishes
    settling = tick(instance, settings, unchanged.cursor)
    assert requested(settling) == [] and settling.skip_reason.skip_message.startswith(
        "waiting for 1 partial checkpoint(s): run/global_step_1/actor (no latest_checkpointed_iteration.txt; a file changed"
    )
    age(role_dir, 61)
    again = tick(instance, settings, settling.cursor)

    [retry] = again.run_requests
    assert retry.partition_key == key and retry.run_key != request.run_key
    # the daemon launches a request unless a run of this sensor has its run key: the first key has one, this one none
    assert instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": request.run_key}))
    assert not instance.get_runs(dg.RunsFilter(tags={"dagster/run_key": retry.run_key}))
    assert materialize(instance, settings, key, tags={**daemon_tags, "dagster/run_key": retry.run_key}).success
    assert requested(tick(instance, settings, again.cursor)) == []  # merged: never again


def test_the_cursor_leads_with_what_the_last_tick_did(fsdp_checkpoint, roots, instance):
    """The sensor's page prints the cursor (the skip reason shows only on hover): its summary comes first."""
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1)
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2")  # no tracker says 2 yet: partial
    settings = roots.settings()

    first = tick(instance, settings)
    second = tick(instance, settings, first.cursor)

    assert list(json.loads(first.cursor)) == ["__class__", "last tick", "keys"]  # shown as name=value pairs, in order
    assert json.loads(first.cursor)["last tick"] == "requested 1 merge(s): run/global_step_1/actor"
    assert json.loads(second.cursor)["last tick"] == second.skip_reason.skip_message
    assert second.skip_reason.skip_message.startswith("waiting for 1 partial checkpoint(s): run/global_step_2/actor (")
    # a cursor written before the summary existed (a plain list of keys) still reads
    assert requested(tick(instance, settings, json.dumps(["run/global_step_1/actor"]))) == []


def test_the_components_sensors_keep_one_merge_or_report_in_flight(fsdp_checkpoint, roots, instance):
    """A project made by create-dagster has no run queue limits: the component's sensor requests one merge
    (the oldest step) and holds back the other complete steps while a merge or a step report of the
    instance is queued or running; its report automation waits while a merge is."""
    from merge_pipeline.dagster.component import MergeCheckpoints
    from merge_pipeline.dagster.instance_names import Names

    sample = fsdp_checkpoint(ACTOR)
    for step in (3, 1, 2):
        roots.drop(sample, f"run/global_step_{step}", link=True)
    (roots.checkpoints / "run" / TRACKER).write_text("3")
    component = MergeCheckpoints(prefix="c", checkpoint_roots=[str(roots.checkpoints)], output_root=str(roots.output))
    built = component.definitions(Names("c"))  # max_concurrent_merges: 1, the default
    merge_job = built.resolve_job_def("c__merge_checkpoint")

    def tick(sensor: str, cursor=None) -> dg.SensorResult:
        context = dg.build_sensor_context(
            instance=instance, cursor=cursor, resources=built.resources, definitions=built
        )
        return built.resolve_sensor_def(sensor)(context)

    first = tick("c__new_checkpoint_sensor")
    assert requested(first) == ["run/global_step_1/actor"]
    assert "2 complete checkpoint(s) held back" in first.cursor
    instance.add_dynamic_partitions("c__checkpoints", requested(first))
    started = tick("c__step_report_automation")
    merged = merge_job.execute_in_process(instance=instance, partition_key="run/global_step_1/actor")
    assert merged.success
    # NOT_STARTED: what the daemon makes of a request, before it queues it
    in_flight = instance.create_run_for_job(merge_job, tags={"dagster/partition": "run/global_step_2/actor"})

    held = tick("c__new_checkpoint_sensor", first.cursor)
    assert requested(held) == [] and "held back" in held.skip_reason.skip_message
    report_held = tick("c__step_report_automation", started.cursor)
    assert requested(report_held) == []  # requested once the merge ended

    instance.report_run_canceled(in_flight)
    report = tick("c__step_report_automation", report_held.cursor)
    assert requested(report) == ["run/global_step_1/actor"]
    [request] = report.run_requests  # a run of the automation's (__ASSET_JOB), counted by its tags
    report_run = instance.create_run_for_job(built.resolve_implicit_global_asset_job_def(), tags=request.tags)
    assert requested(tick("c__new_checkpoint_sensor", held.cursor)) == []  # no merge beside a report
    instance.report_run_canceled(report_run)
    assert requested(tick("c__new_checkpoint_sensor", held.cursor)) == ["run/global_step_2/actor"]
