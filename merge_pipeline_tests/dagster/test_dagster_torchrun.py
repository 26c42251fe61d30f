"""hf_model with ``launcher: torchrun``: ranks launched through Pipes, same folder, same metadata."""

from __future__ import annotations

import dagster as dg
import pytest

from merge_pipeline.dagster.component import MergeCheckpoints
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize
from merge_pipeline_tests.helpers import tree_digest

pytestmark = pytest.mark.torchrun

TORCHRUN = {"max_shard_size": "200KB", "launcher": "torchrun", "nproc_per_node": 2}
INPROCESS = {"max_shard_size": "200KB"}


def weights_metadata(result) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == "state_dict"]
    return event.materialization.metadata


def test_torchrun_launcher_matches_in_process(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "tr/global_step_1", tracker=1)
    roots.drop(sample, "ip/global_step_1", tracker=1)
    settings = roots.settings()

    by_torchrun = materialize(instance, settings, "tr/global_step_1/actor", merge_config=TORCHRUN)
    in_process = materialize(instance, settings, "ip/global_step_1/actor", merge_config=INPROCESS)

    assert by_torchrun.success and in_process.success
    weights = {
        name: digest for name, digest in tree_digest(roots.target("tr/global_step_1/actor")).items() if name != MANIFEST
    }
    assert weights == {
        name: digest for name, digest in tree_digest(roots.target("ip/global_step_1/actor")).items() if name != MANIFEST
    }
    ours, theirs = weights_metadata(by_torchrun), weights_metadata(in_process)
    assert set(ours) - {"peak RSS (largest rank)"} == set(theirs) - {"peak RSS (whole process)"}
    for key in ("tensors", "bytes", "weight files", "files"):
        assert ours[key] == theirs[key], key
    assert ours["launcher"].value == "torchrun x2" and theirs["launcher"].value == "inprocess"
    logs = [e.message for e in instance.all_logs(by_torchrun.run_id) if e.message]
    assert any("torchrun merge of" in m for m in logs), "rank 0 reports through Pipes"


def test_torchrun_launcher_fails_with_the_engine_line(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "bad/global_step_1")
    settings = roots.settings()
    key = "bad/global_step_1/actor"
    rank1 = role_dir / "model_world_size_2_rank_1.pt"
    rank1.write_bytes(rank1.read_bytes()[:1000])  # a rank file cut short
    roots.track(role_dir, 1)  # and the tracker written all the same

    result = materialize(instance, settings, key, merge_config=TORCHRUN)

    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    description = failure.step_failure_data.user_failure_data.description
    assert str(rank1) in description and "\n" not in description
    assert not roots.target(key).exists()


def components_definitions(roots) -> dg.Definitions:
    component = MergeCheckpoints(
        prefix="c", checkpoint_roots=[str(roots.checkpoints)], output_root=str(roots.output), merge_config=TORCHRUN
    )
    return component.definitions(Names("c"))


def test_a_run_without_config_merges_with_the_components_launcher(fsdp_checkpoint, roots, instance):
    """The UI's Materialize (no run config, the assets' own job): the component's merge_config decides."""
    roots.drop(fsdp_checkpoint(ACTOR), "comp/global_step_1", tracker=1)
    defs = components_definitions(roots)
    key = "comp/global_step_1/actor"
    instance.add_dynamic_partitions("c__checkpoints", [key])
    stages = [dg.AssetKey(["c", stage]) for stage in ("parallel_config", "state_dict", "hf_model")]

    result = dg.materialize(
        list(defs.assets), selection=stages, partition_key=key, instance=instance, resources=defs.resources
    )

    assert result.success
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key == stages[1]]
    assert event.materialization.metadata["launcher"].value == "torchrun x2"
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert not any("overrides" in m for m in logs)


def test_a_run_that_overrides_the_components_merge_config_says_so(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "own/global_step_1", tracker=1)
    job = components_definitions(roots).resolve_job_def("c__merge_checkpoint")
    key = "own/global_step_1/actor"
    instance.add_dynamic_partitions("c__checkpoints", [key])
    config = {"ops": {"c__hf_model": {"config": {"launcher": "inprocess", "dtype": "bfloat16"}}}}

    result = job.execute_in_process(run_config=config, partition_key=key, instance=instance)

    assert result.success
    logs = [e.message for e in instance.all_logs(result.run_id) if e.message]
    assert (
        "this run's config overrides the component's merge_config: dtype='bfloat16' (default: 'auto'),"
        " launcher='inprocess' (default: 'torchrun')"
    ) in logs
