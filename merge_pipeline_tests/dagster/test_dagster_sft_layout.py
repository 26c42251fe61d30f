"""The SFT trainer's layout in Dagster: model rank files straight in ``global_step_<N>/``, no role folder."""

from __future__ import annotations

import shutil

import dagster as dg
from safetensors.torch import load_file

from merge_pipeline.defs.discovery import TRACKER
from merge_pipeline.defs.partitions import CheckpointKey
from merge_pipeline.defs.sensors import SOURCE_TAG, new_checkpoint_sensor
from merge_pipeline.sample_checkpoints.fsdp import FsdpSpec
from merge_pipeline_tests.dagster.helpers import materialize
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

SFT = FsdpSpec(layout="sft")
KEY = "run/global_step_4"


def test_sensor_finds_an_sft_step_folder_and_the_chain_merges_it(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(SFT)
    step_dir = roots.checkpoints / "run" / "global_step_4"
    shutil.copytree(sample.role_dir, step_dir)
    tracker = roots.checkpoints / "run" / TRACKER  # the SFT trainer writes it beside the step folders
    tracker.write_text("3")
    settings = roots.settings(settle_seconds=3600)

    def tick(cursor=None) -> dg.SensorResult:
        return new_checkpoint_sensor(dg.build_sensor_context(instance=instance, cursor=cursor, resources={"settings": settings}))

    waiting = tick()
    assert not waiting.run_requests
    assert waiting.skip_reason.skip_message.startswith(f"waiting for 1 partial checkpoint(s): {KEY} ({TRACKER} says 3")
    tracker.write_text("4")
    [request] = tick(waiting.cursor).run_requests
    assert (request.partition_key, request.run_key, request.tags[SOURCE_TAG]) == (KEY, KEY, str(step_dir))
    assert settings.role_dir(CheckpointKey.parse(KEY)) == step_dir

    result = materialize(instance, settings, KEY)
    assert result.success
    assert all(e.passed for e in result.get_asset_check_evaluations()) and len(result.get_asset_check_evaluations()) == 3
    target = roots.output / "run" / "global_step_4"
    merged = load_safetensors_dir(target)
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert set(merged) == set(reference) and all(same_bits(merged[n], t) for n, t in reference.items())
