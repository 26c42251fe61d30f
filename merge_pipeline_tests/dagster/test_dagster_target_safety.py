"""The Dagster assets write under the same lock and rules as the CLI: a folder we did not write is never
replaced, and a merge running on the same target fails the step in one line instead of losing its staging."""

from __future__ import annotations

from merge_pipeline.engine.publish import staging_path
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize
from merge_pipeline_tests.dagster.test_dagster_failures import failure
from merge_pipeline_tests.helpers import merge_in_progress, tree_digest

KEY = "run/global_step_2/actor"


def test_overwrite_refuses_a_folder_it_did_not_write(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)
    target = roots.target(KEY)
    target.mkdir(parents=True)
    (target / "eval.json").write_text('{"accuracy": 0.71}')
    before = tree_digest(target)

    result = materialize(instance, roots.settings(), KEY, merge_config={"overwrite": True})

    assert failure(result) == (
        "hf_model",
        f"{target}: is not empty and has no merge_manifest.json from merge_pipeline: not replaced, even with overwrite: true in hf_model's run config (move it away or choose another MERGE_PIPELINE_OUTPUT_ROOT)",
    )
    assert tree_digest(target) == before and not staging_path(target).exists()


def test_merge_step_fails_in_one_line_while_a_merge_writes_the_target(fsdp_checkpoint, roots, instance):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)
    target = roots.target(KEY)

    with merge_in_progress(target, role_dir) as merge:
        result = materialize(instance, roots.settings(), KEY)
        assert failure(result) == (
            "hf_model",
            f"{target}: another merge (pid {merge.pid}) is writing this target right now",
        )
        assert (staging_path(target) / "model.safetensors").read_bytes() == b"a merge half way", (
            "the running merge's staging must survive"
        )
