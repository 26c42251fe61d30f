"""``averaged_model`` with the merge step's launchers: the average written by torchrun ranks launched
through Pipes, or by Ray tasks on a real multi-node cluster, is byte for byte the one the run's own process
writes; a component's ``merge_config`` sends its averages where it sends its merges."""

from __future__ import annotations

import dagster as dg
import pytest

from local_servers.ray_cluster import local_cluster
from merge_pipeline.dagster.averaged_model import Averaging, averaged_model_definition
from merge_pipeline.dagster.component import MergeCheckpoints
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_tests.dagster.averaged_steps import publish_merged_steps
from merge_pipeline_tests.helpers import tree_digest

SHARDS = {"max_shard_size": "200KB"}  # several weight files: the workers share them
# What names its inputs (their paths differ per run); every other file must be the same bytes.
NAMING_INPUTS = {MANIFEST, "README.md"}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(workers=2) as started:
        yield started


@pytest.fixture
def merged_steps(fsdp_checkpoint, roots, instance):
    """``merged_steps(*runs)``: three merged steps in each run, as hf_model publishes them."""
    return lambda *runs: publish_merged_steps(fsdp_checkpoint, roots, instance, runs)


def average(instance, roots, run: str, config: dict) -> dg.ExecuteInProcessResult:
    """``averaged_model`` of ``<run>/actor`` (the project's own names), with this run config."""
    instance.add_dynamic_partitions("averaged_runs", [f"{run}/actor"])
    return dg.materialize(
        [averaged_model_definition(Names(""), Averaging(last_k=3))],
        partition_key=f"{run}/actor",
        instance=instance,
        resources={"settings": roots.settings()},
        run_config={"ops": {"averaged_model": {"config": config}}},
    )


def metadata(result) -> dict:
    [event] = result.get_asset_materialization_events()
    return event.materialization.metadata


def written(roots, run: str) -> dict[str, str]:
    folder = roots.output / run / "averaged" / "actor"
    assert (folder / MANIFEST).is_file(), "published"
    return {name: digest for name, digest in tree_digest(folder).items() if name not in NAMING_INPUTS}


@pytest.mark.torchrun
def test_torchrun_ranks_write_the_average_the_run_process_would(merged_steps, roots, instance):
    merged_steps("tr", "ip")

    by_torchrun = average(instance, roots, "tr", {**SHARDS, "launcher": "torchrun", "nproc_per_node": 2})
    in_process = average(instance, roots, "ip", SHARDS)

    ours, theirs = written(roots, "tr"), written(roots, "ip")
    assert ours == theirs and len([n for n in ours if n.endswith(".safetensors")]) > 1
    assert metadata(by_torchrun)["launcher"].value == "torchrun x2"
    assert metadata(in_process)["launcher"].value == "inprocess"
    assert "peak RSS (largest rank)" in metadata(by_torchrun)
    logs = [e.message for e in instance.all_logs(by_torchrun.run_id) if e.message]
    assert any("torchrun merge of" in m for m in logs), "rank 0 reports through Pipes"


@pytest.mark.slow
def test_ray_tasks_write_the_average_the_run_process_would(cluster, merged_steps, roots, instance):
    merged_steps("ray", "ip")

    on_ray = average(instance, roots, "ray", {**SHARDS, "launcher": "ray", "ray_address": cluster.address})
    average(instance, roots, "ip", SHARDS)

    assert written(roots, "ray") == written(roots, "ip")
    assert metadata(on_ray)["launcher"].value == f"ray at {cluster.address}"
    logs = [e.message for e in instance.all_logs(on_ray.run_id) if e.message]
    assert any(m.startswith("Ray: 2 write tasks on 2 fitting node(s)") for m in logs)


@pytest.mark.slow
def test_a_components_merge_config_sends_its_averages_to_the_cluster(cluster, fsdp_checkpoint, roots, instance):
    """defs.yaml's ``merge_config`` is averaged_model's default too: the sensor's runs carry no config."""
    publish_merged_steps(fsdp_checkpoint, roots, instance, ("comp",), partitions="c__checkpoints")
    component = MergeCheckpoints(
        prefix="c",
        checkpoint_roots=[str(roots.checkpoints)],
        output_root=str(roots.output),
        averaging=Averaging(last_k=3),
        merge_config={"launcher": "ray", "ray_address": cluster.address, **SHARDS},
    )
    defs = component.definitions(Names("c"))
    instance.add_dynamic_partitions("c__averaged_runs", ["comp/actor"])

    result = defs.resolve_job_def("c__average_run").execute_in_process(partition_key="comp/actor", instance=instance)

    assert result.success and metadata(result)["launcher"].value == f"ray at {cluster.address}"
    assert len([n for n in written(roots, "comp") if n.endswith(".safetensors")]) > 1
