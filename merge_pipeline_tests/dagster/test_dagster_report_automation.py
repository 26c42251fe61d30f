"""step_report follows hf_model through its automation condition: once per merge whose blocking checks
passed, no burst of runs when its sensor is started again after a pause, nothing for older history."""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.component import MergeCheckpoints
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline_tests.dagster.helpers import ACTOR


def requested(result: dg.SensorResult) -> list[str]:
    return sorted(r.partition_key for r in result.run_requests or [])


def test_a_paused_report_automation_requests_one_report_per_merge_made_meanwhile(fsdp_checkpoint, roots, instance):
    """Started again after a pause, the sensor requests one report per partition merged meanwhile (one
    for a partition merged twice), none for the merge before its first tick, and none again next tick."""
    sample = fsdp_checkpoint(ACTOR)
    keys = [f"run/global_step_{step}/actor" for step in (1, 2, 3)]
    for step in (1, 2, 3):
        roots.drop(sample, f"run/global_step_{step}", link=True)
    (roots.checkpoints / "run" / TRACKER).write_text("3")
    component = MergeCheckpoints(
        prefix="c", checkpoint_roots=[str(roots.checkpoints)], output_root=str(roots.output), max_concurrent_merges=0
    )
    built = component.definitions(Names("c"))
    merge_job, automation = (
        built.resolve_job_def("c__merge_checkpoint"),
        built.resolve_sensor_def("c__step_report_automation"),
    )
    instance.add_dynamic_partitions("c__checkpoints", keys)

    def merge(key: str, **config) -> None:
        run_config = {"ops": {"c__hf_model": {"config": config}}} if config else None
        assert merge_job.execute_in_process(instance=instance, partition_key=key, run_config=run_config).success

    def tick(cursor: str | None) -> dg.SensorResult:
        return automation(dg.build_sensor_context(instance=instance, cursor=cursor, definitions=built))

    merge(keys[0])  # history from before the sensor's first tick
    first = tick(None)
    assert requested(first) == []
    # paused: several merges, one partition twice
    merge(keys[1]), merge(keys[2]), merge(keys[1], overwrite=True)
    resumed = tick(first.cursor)
    assert requested(resumed) == keys[1:]
    assert all(r.tags["merge_pipeline/heavy"] == "report" for r in resumed.run_requests)
    assert requested(tick(resumed.cursor)) == []
