"""``promoted_model`` (job ``promote_step``): a published step made what a server pulls, by server-side copies:
``main`` of its repo on the test Hub (no weight byte sent again), ``promoted/<run>/<role>`` in the test bucket."""

from __future__ import annotations

import hashlib
from pathlib import Path

import dagster as dg

from merge_pipeline.dagster.hub_model import HuggingFaceHub
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.hf.manifest import MANIFEST, read_manifest
from merge_pipeline.store.published_prefix import publish_folder
from merge_pipeline_tests.dagster.helpers import ACTOR, asset, materialize
from merge_pipeline_tests.hub.conftest import WRITER
from merge_pipeline_tests.object_store import bucket, s3_server  # noqa: F401 (the S3 server's fixtures)

hub_model, promoted_model = asset("hub_model"), asset("promoted_model")
STEPS = ("run/global_step_1/actor", "run/global_step_2/actor")


def digests(tree: dict[str, bytes]) -> dict[str, str]:
    return {path: hashlib.sha256(data).hexdigest() for path, data in tree.items()}


def test_promotion_commits_a_steps_files_to_main_without_sending_a_weight_byte_again(
    hub, fsdp_checkpoint, roots, instance
):
    settings, hub_resource = roots.settings(), HuggingFaceHub(organization="org", token=WRITER)
    resources = {"settings": settings, "hub": hub_resource}
    for step, key in enumerate(STEPS, 1):
        roots.drop(fsdp_checkpoint(ACTOR), f"run/global_step_{step}", tracker=step, link=True)
        assert materialize(instance, settings, key).success
        assert dg.materialize([hub_model], partition_key=key, instance=instance, resources=resources).success
    verified = {key: digests(hub.tree("org/run-actor", f"global_step_{step}")) for step, key in enumerate(STEPS, 1)}
    # after hub_model verified it, step 2's branch gets another commit: the promotion takes the verified one
    hub.commit("org/run-actor", {"notes.txt": b"later, on the step's branch"}, branch="global_step_2")
    hub.commit("org/run-actor", {"old.txt": b"on main before"})  # main holds exactly the step's files after
    uploads = len(hub.sent("PUT", r"^/lfs/"))
    assert uploads > 0  # the weights went up once, with hub_model

    for key, deleted in ((STEPS[1], "old.txt"), (STEPS[0], "nothing")):
        result = dg.materialize([promoted_model], partition_key=key, instance=instance, resources=resources)

        assert result.success
        head = hub.repos[("model", "org/run-actor")].branches["main"]
        [event] = result.get_asset_materialization_events()
        metadata = event.materialization.metadata
        assert metadata["main"].value == f"{hub.endpoint}/org/run-actor/commit/{head}"
        assert metadata["deleted from main"].value == deleted
        assert digests(hub.tree("org/run-actor", "main")) == verified[key]
    assert len(hub.sent("PUT", r"^/lfs/")) == uploads  # no weight byte sent again


def published_in_the_bucket(store_bucket, fsdp_checkpoint, roots, instance) -> tuple[Path, MergeSettings]:
    """Step 1 merged, then published to the bucket as a store merge publishes it; the settings of that output root."""
    _, name = store_bucket
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1, link=True)
    assert materialize(instance, roots.settings(), STEPS[0]).success
    folder = roots.target(STEPS[0])
    publish_folder(folder, f"s3://{name}/merged/{STEPS[0]}", read_manifest(folder))
    return folder, MergeSettings(checkpoint_roots=[str(roots.checkpoints)], output_root=f"s3://{name}/merged")


def promote(instance, settings: MergeSettings) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [promoted_model],
        partition_key=STEPS[0],
        instance=instance,
        resources={"settings": settings, "hub": HuggingFaceHub(organization="")},
        raise_on_error=False,
    )


def test_promotion_copies_a_step_to_promoted_in_the_bucket_manifest_and_all(bucket, fsdp_checkpoint, roots, instance):  # noqa: F811
    fs, name = bucket
    folder, in_store = published_in_the_bucket(bucket, fsdp_checkpoint, roots, instance)

    result = promote(instance, in_store)

    assert result.success
    promoted = f"{name}/merged/promoted/run/actor"
    copied = {p.removeprefix(promoted + "/"): fs.cat_file(p) for p in fs.find(promoted)}
    assert {n: hashlib.sha256(d).hexdigest() for n, d in copied.items() if n in read_manifest(folder)["files"]} == {
        n: e["sha256"] for n, e in read_manifest(folder)["files"].items()
    }
    assert copied[MANIFEST] == (folder / MANIFEST).read_bytes()
    [event] = result.get_asset_materialization_events()
    assert event.materialization.metadata["promoted prefix"].value == f"s3://{promoted}"


def test_promotion_into_a_prefix_holding_objects_we_did_not_write_is_refused_and_keeps_them(
    bucket,  # noqa: F811
    fsdp_checkpoint,
    roots,
    instance,
):
    """``promoted/<run>/<role>`` follows a merge target's rules: another team's object there is refused in one
    line, before any copy, and stays."""
    fs, name = bucket
    _, in_store = published_in_the_bucket(bucket, fsdp_checkpoint, roots, instance)
    theirs = f"{name}/merged/promoted/run/actor/eval/results.json"
    fs.pipe_file(theirs, b'{"theirs": true}')

    result = promote(instance, in_store)

    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    description = failure.step_failure_data.user_failure_data.description
    assert (
        f"s3://{name}/merged/promoted/run/actor: is not empty and has no {MANIFEST} from merge_pipeline" in description
    )
    assert "\n" not in description
    assert fs.find(f"{name}/merged/promoted") == [theirs] and fs.cat_file(theirs) == b'{"theirs": true}'
