"""The ``hub_model`` asset and the ``publish_latest_steps`` schedule, over a real instance with merged steps."""

from __future__ import annotations

import hashlib
import shutil
import time

import dagster as dg
import pytest
from safetensors.torch import load_file, save_file

from merge_pipeline import __version__
from merge_pipeline.dagster.hub_model import HuggingFaceHub
from merge_pipeline.errors import MergeError
from merge_pipeline.pipeline.merge import merge
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_tests.dagster.helpers import ACTOR, CHAIN, LOCATION, asset, materialize
from merge_pipeline_tests.helpers import tree_digest
from merge_pipeline_tests.hub.conftest import WRITER, silent_endpoint

hub_model, step_report = asset("hub_model"), asset("step_report")
publish_latest_steps = LOCATION.resolve_schedule_def("publish_latest_steps")


def tick(instance, hub_resource):
    return publish_latest_steps(dg.build_schedule_context(instance=instance, resources={"hub": hub_resource}))


def test_schedule_publishes_the_highest_verified_step_of_each_run_once(hub, fsdp_checkpoint, roots, instance):
    settings = roots.settings()
    for step_dir in ("exp/global_step_1", "exp/global_step_2", "exp/global_step_3", "team/other/global_step_5"):
        roots.drop(fsdp_checkpoint(ACTOR), step_dir, tracker=int(step_dir.rsplit("_", 1)[1]), link=True)
        assert materialize(instance, settings, f"{step_dir}/actor", selection=[*CHAIN, step_report]).success
    # Step 3's weights hold a NaN (as a diverged trainer saves them), which its step report finds: its
    # `finite` check fails, it must not be published, step 2 is the run's latest good one.
    weights = roots.target("exp/global_step_3/actor") / "model.safetensors"
    tensors = load_file(weights)
    next(iter(tensors.values())).view(-1)[0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    reported = materialize(instance, settings, "exp/global_step_3/actor", selection=[step_report])
    assert [e.passed for e in reported.get_asset_check_evaluations() if e.check_name == "finite"] == [False]
    hub_resource = HuggingFaceHub(organization="org", token=WRITER)

    requests = tick(instance, hub_resource)

    assert sorted(r.partition_key for r in requests) == ["exp/global_step_2/actor", "team/other/global_step_5/actor"]
    for request in requests:  # what the daemon then runs: the publish job for that partition
        result = dg.materialize(
            [hub_model],
            partition_key=request.partition_key,
            instance=instance,
            resources={"settings": settings, "hub": hub_resource},
        )
        assert result.success
    metadata = _hub_metadata(instance, "exp/global_step_2/actor")
    repo = hub.repos[("model", "org/exp-actor")]
    assert (metadata["repo"].value, metadata["revision"].value) == ("org/exp-actor", "global_step_2")
    assert metadata["commit_url"].value == f"{hub.endpoint}/org/exp-actor/commit/{repo.branches['global_step_2']}"
    assert metadata["url"].value == f"{hub.endpoint}/org/exp-actor/tree/global_step_2"
    target = roots.target("exp/global_step_2/actor")
    assert metadata["files"].value == len(tree_digest(target)) + 1 and metadata["bytes"].value > sum(
        p.stat().st_size for p in target.iterdir()
    )
    on_hub = {p: hashlib.sha256(data).hexdigest() for p, data in hub.tree("org/exp-actor", "global_step_2").items()}
    assert {p: d for p, d in on_hub.items() if p not in ("README.md", ".gitattributes")} == tree_digest(target)
    assert set(repo.branches) == {"main", "global_step_2"} and repo.private
    assert _hub_metadata(instance, "team/other/global_step_5/actor")["repo"].value == "org/team-other-actor"
    assert isinstance(tick(instance, hub_resource), dg.SkipReason)  # once per step

    roots.drop(fsdp_checkpoint(ACTOR), "exp/global_step_4", tracker=4, link=True)
    assert materialize(instance, settings, "exp/global_step_4/actor").success  # its report runs apart, later
    assert isinstance(tick(instance, hub_resource), dg.SkipReason)  # waits for it: not an older step meanwhile
    assert materialize(instance, settings, "exp/global_step_4/actor", selection=[step_report]).success

    assert [r.partition_key for r in tick(instance, hub_resource)] == ["exp/global_step_4/actor"]
    logs = "".join(str(event) for record in instance.get_runs() for event in instance.all_logs(record.run_id))
    assert WRITER not in logs


def test_nothing_is_published_without_an_organization(hub, roots, instance):
    key = "exp/global_step_1/actor"
    instance.add_dynamic_partitions("checkpoints", [key])

    result = dg.materialize(
        [hub_model],
        partition_key=key,
        instance=instance,
        resources={"settings": roots.settings(), "hub": HuggingFaceHub()},
    )

    assert result.success and not result.get_asset_materialization_events()
    assert isinstance(tick(instance, HuggingFaceHub()), dg.SkipReason)
    assert not hub.repos


def test_one_commit_per_step_on_main(hub, merged_folder, fsdp_checkpoint, tmp_path):
    role_dir = shutil.copytree(fsdp_checkpoint(ACTOR).role_dir, tmp_path / "ppo-qwen" / "global_step_8" / "actor")
    step_8 = merge(role_dir, tmp_path / "merged", show_progress=False).target_dir  # unsharded, step 7 has 3 shards
    hub_resource = HuggingFaceHub(
        organization="org", token=WRITER, private=False, revisions="commit", repo_template="{org}/{run_name}"
    )

    for folder, key in ((merged_folder, "ppo-qwen/global_step_7/actor"), (step_8, "ppo-qwen/global_step_8/actor")):
        result = hub_resource.publish(folder, checkpoint_key(key))
        assert (result.repo_id, result.revision) == ("org/ppo-qwen", "main")

    repo = hub.repos[("model", "org/ppo-qwen")]
    assert [c.message for c in repo.commits.values()] == [
        "initial commit",
        *(f"Upload ppo-qwen/global_step_{n}/actor (merge_pipeline {__version__})" for n in (7, 8)),
    ]
    assert set(hub.tree("org/ppo-qwen")) == {
        *tree_digest(step_8),
        "README.md",
        ".gitattributes",
    }  # step 7's shards are gone
    assert "| step | 8 |" in hub.tree("org/ppo-qwen")["README.md"].decode() and not repo.private


def test_a_failed_publish_is_one_line_and_its_run_never_shows_the_token(hub, merged_folder, roots, instance):
    """The Hub quotes the request headers (Authorization included) in its errors: a 503, retried, then a 403."""
    key = "exp/global_step_1/actor"
    instance.add_dynamic_partitions("checkpoints", [key])
    shutil.copytree(merged_folder, roots.target(key))
    hub.fail("POST", "/api/repos/create$", status=503, echo_headers=True)
    hub.fail("POST", "/api/repos/create$", status=403, echo_headers=True)

    result = dg.materialize(
        [hub_model],
        partition_key=key,
        instance=instance,
        resources={"settings": roots.settings(), "hub": HuggingFaceHub(organization="org", token=WRITER)},
        raise_on_error=False,
    )

    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error
    assert failure.message.startswith(
        "dagster._core.definitions.events.Failure: org/exp-actor: the token may not write there (403 Forbidden: injected 403; request headers: {"
    )
    assert "Bearer hf_***" in failure.message and "\n" not in failure.message.strip()
    logs = "".join(str(event) for event in instance.all_logs(result.run_id))
    assert "hub: attempt 1 of 4 failed (HTTP 503 on POST /api/repos/create); retrying in 2 s" in logs
    assert WRITER not in logs


def test_the_resource_timeout_bounds_a_publish_to_a_hub_that_never_answers(hub, merged_folder):
    with silent_endpoint() as endpoint:
        hub_resource = HuggingFaceHub(organization="org", endpoint=endpoint, token=WRITER, timeout_s=0.5)
        started = time.monotonic()
        with pytest.raises(
            MergeError,
            match=r"^org/ppo-qwen-actor: cannot reach http://127\.0\.0\.1:\d+ \(ReadTimeout: timed out on POST /api/repos/create\)",
        ):
            hub_resource.publish(merged_folder, checkpoint_key("ppo-qwen/global_step_7/actor"))
    assert time.monotonic() - started < 4 * 0.5 + 14 + 15  # 4 attempts, 2 + 4 + 8 s apart


def _hub_metadata(instance, partition: str) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(hub_model.key, asset_partitions=[partition]), limit=1
    ).records
    return records[0].asset_materialization.metadata
