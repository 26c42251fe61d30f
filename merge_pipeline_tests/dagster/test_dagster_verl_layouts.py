"""verl 0.9 layouts through the sensor and the asset chain: the SFT trainer's step folder (model rank
files straight in ``global_step_<N>/``, no role folder), LoRA-only rank files, NeMo-Automodel's ``model/``."""

from __future__ import annotations

import json
import shutil

import dagster as dg
from safetensors.torch import load_file

from merge_pipeline.dagster.sensors import SOURCE_TAG
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.hf.folder_checks import index_problems, meta_load_problems
from merge_pipeline.pipeline.merge import merge
from merge_pipeline.watch.discovery import completeness
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_samples.fsdp import FsdpSpec, write_nemo_automodel_checkpoint
from merge_pipeline_tests.dagster.helpers import LOCATION, checks_passed, materialize
from merge_pipeline_tests.helpers import load_safetensors_dir, same_bits

new_checkpoint_sensor = LOCATION.resolve_sensor_def("new_checkpoint_sensor")

SFT = FsdpSpec(layout="sft")
LORA_ONLY = FsdpSpec(lora=(4, 8), lora_only=True)
KEY = "run/global_step_4"


def test_sensor_finds_an_sft_step_folder_and_the_chain_merges_it(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(SFT)
    step_dir = roots.checkpoints / "run" / "global_step_4"
    shutil.copytree(sample.role_dir, step_dir)
    tracker = roots.checkpoints / "run" / TRACKER  # the SFT trainer writes it beside the step folders
    tracker.write_text("3")
    settings = roots.settings(settle_seconds=3600)

    def tick(cursor=None) -> dg.SensorResult:
        return new_checkpoint_sensor(
            dg.build_sensor_context(instance=instance, cursor=cursor, resources={"settings": settings})
        )

    waiting = tick()
    assert not waiting.run_requests
    assert waiting.skip_reason.skip_message.startswith(f"waiting for 1 partial checkpoint(s): {KEY} ({TRACKER} says 3")
    tracker.write_text("4")
    [request] = tick(waiting.cursor).run_requests
    assert (request.partition_key, request.tags[SOURCE_TAG]) == (KEY, str(step_dir))
    assert request.run_key == f"{KEY}@{completeness(step_dir, 4, 3600).newest_change}"  # the step as saved
    assert settings.role_dir(checkpoint_key(KEY)) == step_dir

    result = materialize(instance, settings, KEY)
    assert result.success
    assert checks_passed(result) == CHECK_NAMES
    target = roots.output / "run" / "global_step_4"
    merged = load_safetensors_dir(target)
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert set(merged) == set(reference) and all(same_bits(merged[n], t) for n, t in reference.items())


def test_chain_publishes_a_lora_only_checkpoint_as_a_checked_adapter(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(LORA_ONLY)
    roots.drop(sample, "lora/global_step_2", tracker=2)
    key = "lora/global_step_2/actor"

    result = materialize(instance, roots.settings(), key)

    assert result.success
    assert checks_passed(result) == CHECK_NAMES
    adapter = load_file(roots.target(key) / "adapter_model.safetensors")
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert set(adapter) == {n.replace(".default.", ".") for n in reference if ".lora_" in n}
    assert all(same_bits(adapter[n.replace(".default.", ".")], t) for n, t in reference.items() if ".lora_" in n)


def test_chain_publishes_a_nemo_automodel_checkpoint(tmp_path, roots, instance):
    role_dir = roots.checkpoints / "nemo" / "global_step_3" / "actor"
    write_nemo_automodel_checkpoint(role_dir, FsdpSpec(), reference_dir=tmp_path / "reference")
    (roots.checkpoints / "nemo" / TRACKER).write_text("3")
    key = "nemo/global_step_3/actor"

    result = materialize(instance, roots.settings(), key)

    assert result.success
    assert checks_passed(result) == CHECK_NAMES
    merged = load_safetensors_dir(roots.target(key))
    reference = load_file(tmp_path / "reference" / "model.safetensors")
    assert set(merged) == set(reference) and all(same_bits(merged[n], t) for n, t in reference.items())


def test_adapter_check_finds_a_rank_that_disagrees_with_the_config(fsdp_checkpoint, tmp_path):
    merge(fsdp_checkpoint(LORA_ONLY).role_dir, tmp_path / "adapter", show_progress=False)
    assert meta_load_problems(tmp_path / "adapter") == [] and index_problems(tmp_path / "adapter") == []
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "r": 8}))

    problems = meta_load_problems(tmp_path / "adapter")
    assert (
        len(problems) == 16
        and "model.layers.0.self_attn.k_proj.lora_A.weight: rank 4, but adapter_config.json says r=8" in problems[0]
    )
