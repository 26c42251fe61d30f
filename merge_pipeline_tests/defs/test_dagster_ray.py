"""hf_model with ``launcher: ray``: the step drives Ray tasks on a real multi-node cluster; same folder, its
tasks' reports in the run's event log, the launcher in the metadata."""

from __future__ import annotations

import pytest

from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_tests.defs.helpers import ACTOR, materialize
from merge_pipeline_tests.helpers import tree_digest
from merge_pipeline_tests.ray_cluster import local_cluster

pytestmark = pytest.mark.slow

INPROCESS = {"max_shard_size": "200KB"}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(workers=2) as started:
        yield started


def weights_metadata(result) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == "state_dict"]
    return event.materialization.metadata


def test_ray_launcher_publishes_what_the_run_process_would(cluster, fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "ray/global_step_1", tracker=1)
    roots.drop(sample, "ip/global_step_1", tracker=1)
    settings = roots.settings()

    on_ray = materialize(
        instance,
        settings,
        "ray/global_step_1/actor",
        merge_config={**INPROCESS, "launcher": "ray", "ray_address": cluster.address},
    )
    in_process = materialize(instance, settings, "ip/global_step_1/actor", merge_config=INPROCESS)

    assert on_ray.success and in_process.success
    by_ray, by_run_process = (
        {
            name: digest
            for name, digest in tree_digest(roots.target(f"{run}/global_step_1/actor")).items()
            if name != MANIFEST
        }
        for run in ("ray", "ip")
    )
    assert by_ray == by_run_process  # the manifests name their own source folders
    ours, theirs = weights_metadata(on_ray), weights_metadata(in_process)
    assert ours["launcher"].value == f"ray at {cluster.address}" and theirs["launcher"].value == "inprocess"
    assert set(ours) - {"peak RSS (largest Ray task)"} == set(theirs) - {"peak RSS (whole process)"}
    for key in ("tensors", "bytes", "weight files", "files"):
        assert ours[key] == theirs[key], key
    logs = [e.message for e in instance.all_logs(on_ray.run_id) if e.message]
    assert any(m.startswith("Ray: 2 write tasks on 2 fitting node(s)") for m in logs)
    assert any(m.startswith("Ray task 1/2 on ") for m in logs) and any(m.startswith("Ray task 2/2 on ") for m in logs)
    assert any("per node: " in m for m in logs), "the bytes read per node"


def test_ray_launcher_with_a_request_no_node_satisfies_fails_in_one_line(cluster, fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "big/global_step_1", tracker=1)
    key = "big/global_step_1/actor"

    result = materialize(
        instance,
        roots.settings(),
        key,
        merge_config={"launcher": "ray", "ray_address": cluster.address, "ray_resource": "merge_cpu"},
    )

    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    description = failure.step_failure_data.user_failure_data.description
    assert "no node has resource 'merge_cpu' 1" in description and "\n" not in description
    assert not roots.target(key).exists()
