"""``publish_averaged_models`` over a real instance and the test Hub: a run's average whose blocking checks
passed is requested once per average and lands byte for byte on its branch; one recorded without passed
checks is not; a component without Hub publishing has no such schedule."""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.averaged_model import Averaging
from merge_pipeline.dagster.component import HubPublishing, MergeCheckpoints
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_tests.dagster.averaged_steps import publish_merged_steps
from merge_pipeline_tests.hub.conftest import WRITER

SCHEDULE = "c__publish_averaged_models"


def component(roots, organization: str) -> dg.Definitions:
    return MergeCheckpoints(
        prefix="c",
        checkpoint_roots=[str(roots.checkpoints)],
        output_root=str(roots.output),
        averaging=Averaging(last_k=3),
        hub=HubPublishing(organization=organization),
    ).definitions(Names("c"))


def tick(defs, instance):
    return defs.resolve_schedule_def(SCHEDULE)(dg.build_schedule_context(instance=instance, resources=defs.resources))


def average(defs, instance, run: str) -> None:
    assert defs.resolve_job_def("c__average_run").execute_in_process(partition_key=run, instance=instance).success


def test_each_checked_average_of_a_run_is_published_once(hub, fsdp_checkpoint, roots, instance):
    defs = component(roots, "org")
    assert defs.resolve_schedule_def(SCHEDULE).default_status == dg.DefaultScheduleStatus.RUNNING
    publish_merged_steps(fsdp_checkpoint, roots, instance, ("exp",), partitions="c__checkpoints")
    instance.add_dynamic_partitions("c__averaged_runs", ["exp/actor", "unchecked/actor", "never/actor"])
    assert isinstance(tick(defs, instance), dg.SkipReason)  # nothing averaged yet
    average(defs, instance, "exp/actor")
    # an average recorded without its checks (reported by hand, not averaged by this instance): not published
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key=dg.AssetKey(["c", "averaged_model"]), partition="unchecked/actor")
    )

    [request] = tick(defs, instance)

    assert request.partition_key == "exp/actor"
    published = defs.resolve_job_def("c__publish_averaged_to_hub").execute_in_process(
        partition_key=request.partition_key, instance=instance, tags=request.tags
    )
    assert published.success
    folder = roots.output / "exp" / "averaged" / "actor"
    on_hub = hub.tree("org/exp-actor", "averaged-last-3")
    assert {name: on_hub[name] for name in on_hub if name not in ("README.md", ".gitattributes")} == {
        p.name: p.read_bytes() for p in folder.iterdir()
    } and MANIFEST in on_hub
    assert isinstance(tick(defs, instance), dg.SkipReason)  # once per average

    average(defs, instance, "exp/actor")  # a step landed: the run averaged again

    [again] = tick(defs, instance)
    assert again.partition_key == "exp/actor" and again.run_key != request.run_key
    logs = "".join(str(event) for record in instance.get_runs() for event in instance.all_logs(record.run_id))
    assert WRITER not in logs


def test_without_hub_publishing_there_is_no_averaged_schedule(roots):
    defs = component(roots, "")
    assert not any(s.name == SCHEDULE for s in defs.schedules)
