"""``hub_model`` publishing a step merged into an ``s3://`` output root: streamed from the bucket
through the same view as the CLI's ``upload``, the Hub's tree the bucket's folder file for file; a prefix
without its ``merge_manifest.json`` (a merge still publishing) is refused in one line. ``hub_averaged_model``
publishing a run's average in the bucket the same way."""

from __future__ import annotations

import contextvars
import hashlib

import dagster as dg
import pytest

from merge_pipeline.dagster.averaged_model import Averaging, averaged_model_definition
from merge_pipeline.dagster.hub_model import HuggingFaceHub, hub_averaged_definition
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline_tests.dagster.averaged_steps import publish_merged_steps
from merge_pipeline_tests.dagster.helpers import ACTOR, asset, materialize
from merge_pipeline_tests.dagster.test_dagster_store import KEY, put_step, store_settings
from merge_pipeline_tests.helpers import tree_digest
from merge_pipeline_tests.hub.conftest import WRITER


def publish(instance, settings, key: str) -> dg.ExecuteInProcessResult:
    """``hub_model`` of ``key``, materialized in a fresh ``contextvars.Context``: Dagster keeps the entered
    instance's state storage in a context variable, and one the suite's earlier runs left behind, whose instance
    was collected since, failed the build of these definitions once in CI ("Attempted to resolve undefined
    DagsterInstance weakref"); a fresh context reads none, as a new process does."""
    return contextvars.Context().run(
        dg.materialize,
        [asset("hub_model")],
        partition_key=key,
        instance=instance,
        resources={"settings": settings, "hub": HuggingFaceHub(organization="org", token=WRITER)},
        raise_on_error=False,
    )


@pytest.mark.slow
def test_hub_model_publishes_a_folder_merged_into_the_bucket(hub, bucket, fsdp_checkpoint, instance, tmp_path):
    fs, b = bucket
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY, tracker=1)
    settings = store_settings(b)
    assert materialize(instance, settings, KEY).success

    result = publish(instance, settings, KEY)

    assert result.success, result.all_events
    fs.get(f"{b}/merged/{KEY}/", str(tmp_path / "merged") + "/", recursive=True)
    on_hub = {p: hashlib.sha256(data).hexdigest() for p, data in hub.tree("org/run-actor", "global_step_1").items()}
    assert {p: d for p, d in on_hub.items() if p not in ("README.md", ".gitattributes")} == tree_digest(
        tmp_path / "merged"
    )
    [event] = result.get_asset_materialization_events()
    assert event.materialization.metadata["revision"].value == "global_step_1"


@pytest.mark.slow
def test_hub_model_refuses_a_prefix_without_its_manifest_in_one_line(hub, bucket, fsdp_checkpoint, instance):
    fs, b = bucket
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY, tracker=1)
    settings = store_settings(b)
    assert materialize(instance, settings, KEY).success
    fs.rm_file(f"{b}/merged/{KEY}/merge_manifest.json")  # as while a re-merge publishes

    result = publish(instance, settings, KEY)

    assert not result.success and not hub.repos
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error.message.strip()
    assert failure.endswith(
        f"s3://{b}/merged/{KEY}: incomplete: no merge_manifest.json; a merge is still publishing or failed"
    )
    assert "\n" not in failure


@pytest.mark.slow
def test_hub_averaged_model_publishes_an_average_in_the_bucket(hub, bucket, fsdp_checkpoint, roots, instance, tmp_path):
    fs, b = bucket
    publish_merged_steps(fsdp_checkpoint, roots, instance, ("local",))
    for step in (1, 2, 3):  # the merged steps, published in the bucket's output root
        key = f"exp/global_step_{step}/actor"
        fs.put(str(roots.target(f"local/global_step_{step}/actor")) + "/", f"{b}/merged/{key}/", recursive=True)
        instance.add_dynamic_partitions("checkpoints", [key])
    settings = MergeSettings(checkpoint_roots=[str(roots.checkpoints)], output_root=f"s3://{b}/merged")
    instance.add_dynamic_partitions("averaged_runs", ["exp/actor"])
    hub_resource = HuggingFaceHub(organization="org", token=WRITER)
    assert dg.materialize(
        [averaged_model_definition(Names(""), Averaging(last_k=3))],
        partition_key="exp/actor",
        instance=instance,
        resources={"settings": settings},
    ).success

    result = contextvars.Context().run(  # a fresh context, as publish() says
        dg.materialize,
        [hub_averaged_definition(Names(""))],
        partition_key="exp/actor",
        instance=instance,
        resources={"settings": settings, "hub": hub_resource},
        raise_on_error=False,
    )

    assert result.success, [e.message for e in result.all_events if e.is_step_failure]
    fs.get(f"{b}/merged/exp/averaged/actor/", str(tmp_path / "averaged") + "/", recursive=True)
    on_hub = {p: hashlib.sha256(d).hexdigest() for p, d in hub.tree("org/exp-actor", "averaged-last-3").items()}
    assert {p: d for p, d in on_hub.items() if p not in ("README.md", ".gitattributes")} == tree_digest(
        tmp_path / "averaged"
    )
    [event] = result.get_asset_materialization_events()
    assert event.materialization.metadata["revision"].value == "averaged-last-3"
