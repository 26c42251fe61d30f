"""A failed merge fails its run with the engine's one-line error, publishes nothing and leaves no staging."""

from __future__ import annotations

import json

import dagster as dg

from merge_pipeline.engine.publish import staging_path
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize
from merge_pipeline_tests.helpers import tree_digest

KEY = "run/global_step_2/actor"


def failure(result: dg.ExecuteInProcessResult) -> tuple[str, str]:
    """(step, description) of the run's one failed step."""
    [event] = [e for e in result.all_events if e.is_step_failure]
    return event.step_key, event.step_failure_data.user_failure_data.description


def assert_nothing_published(instance, roots, key=KEY):
    target = roots.target(key)
    assert not target.exists() and not staging_path(target).exists()
    assert not target.parent.exists()  # nor the step folder the merge made for it in the output root
    for stage in (
        "parallel_config",
        "state_dict",
        "hf_model",
    ):  # one step: no stage describes a folder that is not there
        assert instance.get_latest_materialization_event(dg.AssetKey(stage)) is None, stage


def test_corrupt_rank_file_fails_with_one_line_naming_it(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2")
    rank_file = role_dir / "model_world_size_2_rank_1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[: rank_file.stat().st_size // 2])  # a crash mid-write
    roots.track(role_dir, 2)  # and the tracker written all the same

    result = materialize(instance, roots.settings(), KEY)

    assert not result.success
    step, description = failure(result)
    assert step == "hf_model"
    assert description == f"{rank_file}: not a readable zip archive, truncated or corrupt (File is not a zip file)"
    assert_nothing_published(instance, roots)


def test_failure_while_writing_weights_removes_the_staging_folder(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)

    result = materialize(instance, roots.settings(), KEY, merge_config={"max_shard_size": "a lot"})

    step, description = failure(result)
    assert step == "hf_model" and description.startswith("max_shard_size 'a lot': ") and "\n" not in description
    assert_nothing_published(instance, roots)


def test_a_failed_blocking_check_publishes_nothing_and_says_so(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2")
    config_path = role_dir / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    layers = config["num_hidden_layers"]
    config_path.write_text(
        json.dumps({**config, "num_hidden_layers": layers + 1, "layer_types": config["layer_types"][:1] * (layers + 1)})
    )  # a layer's weights missing
    roots.track(role_dir, 2)  # the trainer's tracker, after the save as edited
    before = tree_digest(role_dir)

    result = materialize(instance, roots.settings(), KEY)

    step, description = failure(result)
    # the CLI's line (test_checks_before_publishing), naming the check, the folder and its first problem
    assert step == "hf_model" and description.startswith(
        f"{roots.target(KEY)}: not published: blocking check(s) loads_on_meta_device failed on the merged folder: "
        f"missing from the weights: model.layers.{layers}."
    )
    assert "\n" not in description
    # hf_model's checks for the partition: the refusing one failed, with its problem; nothing was published
    refused = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert refused == {"loads_on_meta_device": False, "index_matches_shards": True, "manifest_sha256": True}
    [event] = [e for e in result.all_events if e.is_step_failure]
    assert event.step_failure_data.user_failure_data.metadata["next step"].value.startswith("fix the checkpoint")
    assert_nothing_published(instance, roots)
    assert tree_digest(role_dir) == before


def test_existing_merged_folder_is_kept_unless_overwrite_is_asked(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)
    settings = roots.settings()
    assert materialize(instance, settings, KEY).success
    target = roots.target(KEY)
    before = tree_digest(target)

    refused = materialize(instance, settings, KEY, merge_config={"dtype": "bfloat16"})
    assert failure(refused) == (
        "hf_model",
        f"{target}: already exists (set overwrite: true in hf_model's run config to replace it once the new merge is complete)",
    )
    [event] = [e for e in refused.all_events if e.is_step_failure]
    metadata = event.step_failure_data.user_failure_data.metadata
    assert metadata["file"].value == str(target)
    assert (
        metadata["next step"].value
        == "to replace it, materialize the partition again with overwrite: true in hf_model's run config (Launchpad)"
    )
    assert tree_digest(target) == before

    replaced = materialize(instance, settings, KEY, merge_config={"dtype": "bfloat16", "overwrite": True})
    assert replaced.success and tree_digest(target) != before and not staging_path(target).exists()


def test_incomplete_checkpoint_is_not_merged(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=1)  # the trainer is still saving step 2

    result = materialize(instance, roots.settings(settle_seconds=3600), KEY)

    step, description = failure(result)
    assert step == "hf_model" and description.startswith(
        f"{role_dir}: incomplete checkpoint: latest_checkpointed_iteration.txt says 1; a file changed "
    )
    assert_nothing_published(instance, roots)


def test_unknown_partition_fails_with_one_line(roots, instance):
    result = materialize(instance, roots.settings(), "run/global_step_9/actor")

    step, description = failure(result)
    assert (step, description) == (
        "hf_model",
        f"{roots.checkpoints / 'run/global_step_9/actor'}: no such checkpoint folder under the checkpoint roots (deleted by the trainer's rotation?)",
    )
