"""hf_model with ``launcher: ray``: the step drives Ray tasks on a real multi-node cluster; same folder, its
tasks' reports in the run's event log, the launcher in the metadata."""

from __future__ import annotations

import http.server
import threading
import time

import dagster as dg
import pytest

from local_servers.ray_cluster import local_cluster
from merge_pipeline.dagster.component import MergeCheckpoints
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.engine.publish import lock_path, staging_path
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize
from merge_pipeline_tests.helpers import tree_digest

INPROCESS = {"max_shard_size": "200KB"}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(workers=2) as started:
        yield started


def weights_metadata(result) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == "state_dict"]
    return event.materialization.metadata


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_ray_launcher_at_a_web_server_fails_in_one_line_before_any_work(fsdp_checkpoint, roots, instance):
    """``ray_address`` at Ray's dashboard port (any web server): the step fails in seconds in one line, with
    no lock or staging made (before: ~14 minutes inside ray.init, after both were made)."""
    roots.drop(fsdp_checkpoint(ACTOR), "web/global_step_1", tracker=1)
    key = "web/global_step_1/actor"
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler) as web:
        threading.Thread(target=web.serve_forever, daemon=True).start()
        address = f"127.0.0.1:{web.server_address[1]}"
        started = time.monotonic()
        result = materialize(instance, roots.settings(), key, merge_config={"launcher": "ray", "ray_address": address})
        took = time.monotonic() - started
        web.shutdown()

    assert not result.success and took < 60
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    description = failure.step_failure_data.user_failure_data.description
    assert f"Ray cluster at {address}: not answered as by a Ray head's GCS port within 5 s" in description
    assert "\n" not in description
    target = roots.target(key)
    assert not target.exists() and not staging_path(target).exists() and not lock_path(target).exists()


@pytest.mark.slow
def test_a_components_merge_config_sends_the_sensors_runs_to_the_cluster(cluster, fsdp_checkpoint, roots, instance):
    """defs.yaml's ``merge_config`` is the merge job's default: a run with no config of its own (the
    sensor's) merges on Ray."""
    roots.drop(fsdp_checkpoint(ACTOR), "comp/global_step_1", tracker=1)
    component = MergeCheckpoints(
        prefix="c",
        checkpoint_roots=[str(roots.checkpoints)],
        output_root=str(roots.output),
        merge_config={"launcher": "ray", "ray_address": cluster.address, "max_shard_size": "200KB"},
    )
    job = component.definitions(Names("c")).resolve_job_def("c__merge_checkpoint")
    key = "comp/global_step_1/actor"
    instance.add_dynamic_partitions("c__checkpoints", [key])

    result = job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False)

    assert result.success
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == "c/state_dict"]
    assert event.materialization.metadata["launcher"].value == f"ray at {cluster.address}"
    assert len(list(roots.target(key).glob("model-*-of-*.safetensors"))) > 1


def test_a_components_merge_config_is_checked_when_the_definitions_load():
    with pytest.raises(MergeError, match="merge_config: unknown field"):
        MergeCheckpoints(merge_config={"launcher": "ray", "ray_adress": "head:6379"}).definitions(Names("c"))
    with pytest.raises(MergeError, match="ray-tasks 0: must be at least 1"):
        MergeCheckpoints(merge_config={"launcher": "ray", "ray_tasks": 0}).definitions(Names("c"))


def test_a_run_without_config_gets_the_components_merge_config():
    """What the UI's Materialize (the assets' own job), dg launch and ``merge-pipeline queue`` (the job, through the
    webserver) start with no run config: Dagster fills hf_model's config from its defaults, the merge_config."""
    merge_config = {"launcher": "ray", "ray_address": "head:6379", "ray_env_vars": ["MY_TOKEN"]}
    defs = MergeCheckpoints(merge_config=merge_config).definitions(Names("c"))

    for job in ("c__merge_checkpoint", "__ASSET_JOB"):
        config = dg.validate_run_config(defs.resolve_job_def(job), {})["ops"]["c__hf_model"]["config"]
        assert {name: config[name] for name in merge_config} == merge_config, job
