"""The Dagster side of the target rules over a bucket (``merge_pipeline/target_rules.py``): an output root that
is a checkpoint root (a slip in ``.env``) is not watched, and a merge into it is refused, every object kept."""

from __future__ import annotations

import hashlib

import pytest

from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.watch.cursor import cursor_keys
from merge_pipeline_tests.dagster.helpers import ACTOR, materialize
from merge_pipeline_tests.dagster.test_dagster_sensor import requested, tick
from merge_pipeline_tests.dagster.test_dagster_store import KEY, put_step, skip_message

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("output_root", ["s3://{b}/ckpts", "s3://{b}/ckpts/"])
def test_an_output_root_that_is_the_checkpoint_root_is_not_watched_and_merges_nothing(
    bucket, fsdp_checkpoint, instance, output_root
):
    fs, b = bucket
    put_step(fs, b, fsdp_checkpoint(ACTOR), KEY, tracker=1)  # complete: a watched root would request it
    settings = MergeSettings(checkpoint_roots=[f"s3://{b}/ckpts"], output_root=output_root.format(b=b))
    before = {key: hashlib.sha256(fs.cat_file(key)).hexdigest() for key in fs.find(b, refresh=True)}

    result = tick(instance, settings)

    assert requested(result) == [] and cursor_keys(result.cursor) == {}
    assert skip_message(result).startswith(
        f"not watched: s3://{b}/ckpts: the output root is the checkpoint root s3://{b}/ckpts (not scanned: "
        "each merge would write into its input; keep them apart)"
    ), skip_message(result)

    merged = materialize(instance, settings, KEY)  # launched by hand all the same
    assert not merged.success
    [failure] = [e for e in merged.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message.strip()
    assert "\n" not in message
    assert (
        f"s3://{b}/ckpts/{KEY}: is the input checkpoint s3://{b}/ckpts/{KEY}: choose a MERGE_PIPELINE_OUTPUT_ROOT outside it"
        in message
    ), message
    assert {key: hashlib.sha256(fs.cat_file(key)).hexdigest() for key in fs.find(b, refresh=True)} == before


def test_an_output_root_that_is_the_checkpoint_folder_is_not_watched_either(fsdp_checkpoint, roots, instance):
    """The same rule for folders (before: the root scanned and the step requested, its merge into itself)."""
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1)
    settings = MergeSettings(checkpoint_roots=[str(roots.checkpoints)], output_root=str(roots.checkpoints) + "/")

    result = tick(instance, settings)

    assert requested(result) == [] and cursor_keys(result.cursor) == {}
    assert skip_message(result).startswith(
        f"not watched: {roots.checkpoints}: the output root is the checkpoint root {roots.checkpoints} (not scanned"
    ), skip_message(result)
