"""Dagster's paths into object storage that a merge on local disk does not take, on the
real S3 server of ``object_store.py``: ``averaged_model`` writing into an ``s3://`` output root, and the
merge step's torchrun and Ray launchers with ``s3://`` checkpoint and output roots. Each is held byte for
byte to the same work done in the run's own process (and, for the average, on local disk)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from local_servers.ray_cluster import local_cluster
from merge_pipeline.dagster.averaged_model import Averaging, averaged_model_definition
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_tests.dagster.averaged_steps import publish_merged_steps
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize
from merge_pipeline_tests.dagster.test_dagster_store import put_step, store_settings
from merge_pipeline_tests.helpers import assert_bit_exact, tree_digest
from merge_pipeline_tests.object_store import download, weights_and_index

pytestmark = pytest.mark.slow

SHARDS = {"max_shard_size": "200KB"}  # several weight files: the ranks and tasks share them
# What names its inputs by where they were read; every other file must be the same bytes.
NAMING_INPUTS = {MANIFEST, "README.md"}


def average(instance, settings: MergeSettings, run: str) -> dg.ExecuteInProcessResult:
    """``averaged_model`` of ``<run>/actor`` over the last 3 merged steps, in the run's own process."""
    instance.add_dynamic_partitions("averaged_runs", [f"{run}/actor"])
    return dg.materialize(
        [averaged_model_definition(Names(""), Averaging(last_k=3))],
        partition_key=f"{run}/actor",
        instance=instance,
        resources={"settings": settings},
        run_config={"ops": {"averaged_model": {"config": SHARDS}}},
        raise_on_error=False,
    )


def all_but_inputs(folder: Path) -> dict[str, str]:
    return {name: digest for name, digest in tree_digest(folder).items() if name not in NAMING_INPUTS}


def test_an_average_written_into_the_bucket_is_the_local_average(bucket, fsdp_checkpoint, roots, instance, tmp_path):
    fs, b = bucket
    publish_merged_steps(fsdp_checkpoint, roots, instance, ("local",))
    for step in (1, 2, 3):  # the same merged steps, published in the bucket's output root
        key = f"store/global_step_{step}/actor"
        fs.put(str(roots.target(f"local/global_step_{step}/actor")) + "/", f"{b}/merged/{key}/", recursive=True)
        instance.add_dynamic_partitions("checkpoints", [key])
    in_bucket = MergeSettings(checkpoint_roots=[str(roots.checkpoints)], output_root=f"s3://{b}/merged")

    on_disk = average(instance, roots.settings(), "local")
    into_bucket = average(instance, in_bucket, "store")

    assert on_disk.success
    assert into_bucket.success, [e.message for e in into_bucket.all_events if e.event_type_value == "STEP_FAILURE"]
    target = f"s3://{b}/merged/store/averaged/actor"
    assert fs.isfile(f"{target.removeprefix('s3://')}/{MANIFEST}")
    local = all_but_inputs(roots.output / "local" / "averaged" / "actor")
    assert all_but_inputs(download(fs, target, tmp_path / "averaged")) == local
    assert len([n for n in local if n.endswith(".safetensors")]) > 1
    [event] = into_bucket.get_asset_materialization_events()
    metadata = event.materialization.metadata
    assert metadata["path"].value == target and metadata["steps"].value == [1, 2, 3]


@pytest.fixture
def stored_steps(bucket, fsdp_checkpoint):
    """``stored_steps(*runs)``: the same FSDP step uploaded under each run of the bucket's checkpoint root."""
    fs, b = bucket
    sample = fsdp_checkpoint(ACTOR)

    def put(*runs: str) -> tuple[MergeSettings, object]:
        for run in runs:
            put_step(fs, b, sample, f"{run}/global_step_1/actor", tracker=1)
        return store_settings(b), sample

    return put


def launcher(result: dg.ExecuteInProcessResult) -> str:
    """Who wrote the weights, as the state_dict stage records it."""
    [written] = [e for e in result.get_asset_materialization_events() if e.asset_key.path == ["state_dict"]]
    return written.materialization.metadata["launcher"].value


def merged_in_bucket(fs, b: str, run: str, into: Path) -> Path:
    return download(fs, f"s3://{b}/merged/{run}/global_step_1/actor", into / run)


@pytest.mark.torchrun
def test_torchrun_ranks_merge_a_step_from_the_bucket_into_it_as_the_run_process(
    bucket, stored_steps, instance, tmp_path
):
    fs, b = bucket
    settings, sample = stored_steps("tr", "ip")

    by_torchrun = materialize(
        instance,
        settings,
        "tr/global_step_1/actor",
        merge_config={**SHARDS, "launcher": "torchrun", "nproc_per_node": 2},
    )
    in_process = materialize(instance, settings, "ip/global_step_1/actor", merge_config=SHARDS)

    assert by_torchrun.success, [e.message for e in by_torchrun.all_events if e.event_type_value == "STEP_FAILURE"]
    assert in_process.success
    ours, theirs = merged_in_bucket(fs, b, "tr", tmp_path), merged_in_bucket(fs, b, "ip", tmp_path)
    assert weights_and_index(ours) == weights_and_index(theirs)
    assert len([n for n in weights_and_index(ours) if n.endswith(".safetensors")]) > 1
    assert_bit_exact(ours, sample.reference_dir)
    assert launcher(by_torchrun) == "torchrun x2" and launcher(in_process) == "inprocess"


def test_ray_tasks_merge_a_step_from_the_bucket_into_it_as_the_run_process(bucket, stored_steps, instance, tmp_path):
    fs, b = bucket
    settings, sample = stored_steps("ray", "ip")

    with local_cluster(workers=2) as cluster:  # started with the store's variables set, as a cluster's nodes have them
        address = cluster.address
        on_ray = materialize(
            instance,
            settings,
            "ray/global_step_1/actor",
            merge_config={**SHARDS, "launcher": "ray", "ray_address": address},
        )
    in_process = materialize(instance, settings, "ip/global_step_1/actor", merge_config=SHARDS)

    assert on_ray.success, [e.message for e in on_ray.all_events if e.event_type_value == "STEP_FAILURE"]
    assert in_process.success
    ours, theirs = merged_in_bucket(fs, b, "ray", tmp_path), merged_in_bucket(fs, b, "ip", tmp_path)
    assert weights_and_index(ours) == weights_and_index(theirs)
    assert_bit_exact(ours, sample.reference_dir)
    logs = [e.message for e in instance.all_logs(on_ray.run_id) if e.message]
    assert any(m.startswith("Ray: 2 write tasks on 2 fitting node(s)") for m in logs), logs
    assert launcher(on_ray) == f"ray at {address}"
