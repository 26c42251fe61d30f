"""The Dagster assets write under the same lock and rules as the CLI: a folder we did not write is never
replaced, and a merge running on the same target fails the step in one line instead of losing its staging."""

from __future__ import annotations

from merge_pipeline.defs import assets
from merge_pipeline.engine.publish import staging_path
from merge_pipeline_tests.dagster.helpers import ACTOR, CHAIN, materialize
from merge_pipeline_tests.dagster.test_dagster_failures import failure
from merge_pipeline_tests.helpers import merge_in_progress, tree_digest

KEY = "run/global_step_2/actor"
WEIGHTS = [assets.checkpoint, assets.parallel_config, assets.merged_state_dict]


def test_overwrite_refuses_a_folder_it_did_not_write(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)
    target = roots.target(KEY)
    target.mkdir(parents=True)
    (target / "eval.json").write_text('{"accuracy": 0.71}')
    before = tree_digest(target)

    result = materialize(instance, roots.settings(), KEY, merge_config={"overwrite": True})

    assert failure(result) == ("merged_state_dict", f"{target}: is not empty and has no merge_manifest.json from merge_pipeline: not replaced, even with --overwrite (move it away or choose another --target_dir)")
    assert tree_digest(target) == before and not staging_path(target).exists()


def test_weights_step_fails_in_one_line_while_a_merge_writes_the_target(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)
    target = roots.target(KEY)

    with merge_in_progress(target, role_dir) as merge:
        result = materialize(instance, roots.settings(), KEY)
        assert failure(result) == ("merged_state_dict", f"{target}: another merge (pid {merge.pid}) is writing this target right now")
        assert (staging_path(target) / "model.safetensors").read_bytes() == b"a merge half way", "the running merge's staging must survive"


def test_publish_step_fails_in_one_line_while_a_merge_writes_the_target(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)
    target, settings = roots.target(KEY), roots.settings()
    assert materialize(instance, settings, KEY, selection=WEIGHTS).success

    with merge_in_progress(target, role_dir) as merge:  # a CLI merge started between the two steps
        result = materialize(instance, settings, KEY, selection=[a for a in CHAIN if a not in WEIGHTS])
        assert failure(result) == ("hf_model", f"{target}: another merge (pid {merge.pid}) is writing this target right now")
        assert (staging_path(target) / "model.safetensors").read_bytes() == b"a merge half way", "the running merge's staging must survive"
        assert not target.exists()
