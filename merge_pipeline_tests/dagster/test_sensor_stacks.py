"""``new_checkpoint_sensor`` over the step folders of the DCP, DeepSpeed and Megatron-LM stacks
(torchtitan, the HF Trainer / accelerate, NeMo-RL, DeepSpeed save dirs, Megatron-LM's iter_<N>), with
real checkpoints from the sample writers: one partition each, merged by the run exactly as by the CLI,
and a half-written save never offered."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import dagster as dg
import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.watch.discovery import completeness
from merge_pipeline.watch.partitions import checkpoint_key
from merge_pipeline_tests.dagster.helpers import LOCATION, materialize
from merge_pipeline_tests.helpers import assert_bit_exact, load_safetensors_dir, run_cli, same_bits

new_checkpoint_sensor = LOCATION.resolve_sensor_def("new_checkpoint_sensor")

DEEPSPEED = "zero2-tied-frozen"  # config.json and tokenizer beside `latest`, as the HF Trainer saves them
DCP_DONE = "DCP: .metadata present (dcp.save's coordinator writes it after every rank's data)"
DEEPSPEED_DONE = "DeepSpeed: latest names this tag and every rank's *_optim_states.pt is there"


def tick(instance, settings, cursor=None) -> dg.SensorResult:
    return new_checkpoint_sensor(
        dg.build_sensor_context(instance=instance, cursor=cursor, resources={"settings": settings})
    )


def requested(result: dg.SensorResult) -> list[str]:
    return [r.partition_key for r in result.run_requests or []]


def place(source: Path, root: Path, folder: str) -> Path:
    """A copy of a sample checkpoint at ``root/folder``, with fresh mtimes, as its trainer just saved it:
    DeepSpeed's ``latest`` last (a ``latest`` older than its tag's files is an earlier run's)."""
    shutil.copytree(source, root / folder, copy_function=shutil.copy)
    for latest in (root / folder).rglob("latest"):
        os.utime(latest)
    return root / folder


@pytest.fixture
def stacks(roots, dcp_sample, deepspeed_checkpoints) -> dict[str, tuple[Path, Path | None]]:
    """One checkpoint of each stack under the watched root: partition key -> (its folder, the
    hf_model_path its merge needs: None when the checkpoint holds its config)."""
    save_dir, reference_dir = deepspeed_checkpoints[DEEPSPEED]
    titan, accelerate, nemo_rl = (dcp_sample(source) for source in ("torchtitan", "accelerate", "nemo_rl"))
    root = roots.checkpoints
    return {
        "titan/checkpoint/step-10": (place(titan.folder, root, "titan/checkpoint/step-10"), titan.original_dir),
        "openrlhf/ckpt/global_step2": (place(save_dir, root, "openrlhf/ckpt") / "global_step2", reference_dir),
        "hf/checkpoint-2": (place(save_dir, root, "hf/checkpoint-2"), None),
        "acc/checkpoint-1": (place(accelerate.folder, root, "acc/checkpoint-1"), accelerate.original_dir),
        "nemo/step_1/policy": (place(nemo_rl.folder, root, "nemo/step_1/policy"), nemo_rl.original_dir),
    }


def test_each_stack_gets_one_partition_merged_as_the_cli_merges_it(capsys, tmp_path, roots, instance, stacks):
    settings = roots.settings(settle_seconds=0)

    result = tick(instance, settings)

    assert sorted(requested(result)) == sorted(stacks)
    why = {e.partition: e.metadata["completeness"].value for e in result.asset_events}
    # each event names its stack as the readers declare the step folder (the UI's descriptions name none)
    assert {e.partition: e.metadata["stack"].value for e in result.asset_events} == {
        "titan/checkpoint/step-10": "torchtitan",
        "openrlhf/ckpt/global_step2": "DeepSpeed",
        "hf/checkpoint-2": "the HF Trainer",
        "acc/checkpoint-1": "the HF Trainer",
        "nemo/step_1/policy": "NeMo-RL",
    }
    for key, (folder, _) in stacks.items():
        assert why[key].startswith(DEEPSPEED_DONE if "global_step2" in key or "checkpoint-2" in key else DCP_DONE)
        parsed = checkpoint_key(key)
        assert str(parsed) == key and settings.role_dir(parsed) == folder
    assert {str(f.key): f.role_dir for f in settings.find_checkpoints().found} == {k: f for k, (f, _) in stacks.items()}

    for number, (key, (folder, hf_model_path)) in enumerate(stacks.items()):
        config = {"hf_model_path": str(hf_model_path)} if hf_model_path else None
        assert materialize(instance, settings, key, merge_config=config).success, key
        flags = ["--hf_model_path", hf_model_path] if hf_model_path else []
        cli_target = tmp_path / "cli" / str(number)
        code, _, err = run_cli(
            capsys, "merge", "--local_dir", folder, "--target_dir", cli_target, "--no-progress", *flags
        )
        assert code == 0, err
        by_sensor, by_cli = load_safetensors_dir(roots.target(key)), load_safetensors_dir(cli_target)
        assert by_sensor.keys() == by_cli.keys() and by_cli, key
        assert all(same_bits(by_sensor[name], by_cli[name]) for name in by_cli), key


def test_a_half_written_save_is_not_offered_and_the_skip_reason_says_why(
    roots, instance, dcp_sample, deepspeed_checkpoints
):
    titan = place(dcp_sample("torchtitan").folder, roots.checkpoints, "titan/step-10")
    save_dir = place(deepspeed_checkpoints[DEEPSPEED][0], roots.checkpoints, "ds/ckpt")
    metadata, aside = titan / ".metadata", roots.checkpoints.parent / "metadata.aside"
    metadata.rename(aside)  # dcp.save: every rank's data written, the coordinator's .metadata not yet
    (save_dir / "latest").write_text("global_step1")  # DeepSpeed: the new tag written, `latest` not yet
    settings = roots.settings(settle_seconds=0)

    first = tick(instance, settings)

    assert requested(first) == []
    assert first.skip_reason.skip_message == (
        "waiting for 2 partial checkpoint(s): "
        "titan/step-10 (DCP: no .metadata yet (dcp.save's coordinator writes it after every rank's data)); "
        "ds/ckpt/global_step2 (DeepSpeed: latest names global_step1, not global_step2 yet (DeepSpeed writes it after every rank's files))"
    )

    (save_dir / "latest").write_text("global_step2")
    rank_1 = save_dir / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank_1.rename(aside.with_name("rank_1.aside"))  # copied over by hand, one rank's file still missing
    second = tick(instance, settings, first.cursor)
    assert requested(second) == []
    assert (
        "ds/ckpt/global_step2 (DeepSpeed: latest names this tag, but 1 rank file(s) missing: zero_pp_rank_1_mp_rank_00_optim_states.pt)"
        in second.skip_reason.skip_message
    )

    aside.with_name("rank_1.aside").rename(rank_1)
    aside.rename(metadata)
    assert not completeness(titan, 10, 3600).complete  # .metadata alone is not enough: the settle time too
    assert requested(tick(instance, settings, second.cursor)) == ["titan/step-10", "ds/ckpt/global_step2"]

    # A tag older than the one `latest` names was finished before the newer save began.
    shutil.copytree(save_dir / "global_step2", save_dir / "global_step3")
    (save_dir / "latest").write_text("global_step3")
    assert completeness(save_dir / "global_step2", 2, 3600).reason == (
        "DeepSpeed: latest names the later tag global_step3 and every rank's *_optim_states.pt is there"
    )
    # Model states that cannot be read (still being copied) do not tell the dp world size: the settle time decides.
    model_states = save_dir / "global_step3" / "mp_rank_00_model_states.pt"
    model_states.write_bytes(model_states.read_bytes()[:100])
    waiting = completeness(save_dir / "global_step3", 3, 3600)
    assert not waiting.complete and waiting.reason.startswith(
        "DeepSpeed: latest names this tag; the model states do not say the dp world size; a file changed"
    )
    assert completeness(save_dir / "global_step3", 3, 0).complete


def test_an_earlier_runs_latest_does_not_skip_the_settle_time(roots, instance, deepspeed_checkpoints):
    """DeepSpeed's ``latest`` left by an earlier run (naming a later tag, or this one) while a tag is saved again."""
    save_dir = place(deepspeed_checkpoints[DEEPSPEED][0], roots.checkpoints, "ds/ckpt")
    latest = save_dir / "latest"
    then = time.time() - 600
    for named in ("global_step9", "global_step2"):
        latest.write_text(named)
        os.utime(latest, (then, then))  # before every file of the tag below was written

        state = completeness(save_dir / "global_step2", 2, 3600)

        assert not state.complete and state.reason.startswith(
            f"DeepSpeed: latest names {'the later tag global_step9' if named == 'global_step9' else 'this tag'}, "
            "but was written before the tag's last change (an earlier run's?); a file changed"
        )
    assert requested(tick(instance, roots.settings(settle_seconds=3600))) == []
    assert completeness(save_dir / "global_step2", 2, 0).complete  # the settle time decides
    os.utime(latest)  # written after the tag: it speaks for it
    assert completeness(save_dir / "global_step2", 2, 3600).reason == DEEPSPEED_DONE


def test_a_latest_file_naming_no_tag_folder_is_not_offered(roots, deepspeed_checkpoints):
    checkpoint = place(deepspeed_checkpoints[DEEPSPEED][0], roots.checkpoints, "hf/checkpoint-2")
    for tag in ("../../global_step2", "global_step9"):
        (checkpoint / "latest").write_text(tag)
        state = completeness(checkpoint, 2, 0)
        assert (
            not state.complete and state.reason == f"DeepSpeed: latest names {tag!r}, which is no tag folder beside it"
        )


@pytest.mark.parametrize(
    ("step_dir", "stack"),
    [
        ("step-010", "torchtitan names step folders step-<N>"),
        ("checkpoint-٣", "the HF Trainer"),
        ("iter_100", "Megatron-LM names step folders iter_<N> with ASCII digits, zero-padded to 7"),
    ],
)
def test_step_folders_of_other_stacks_that_do_not_map_back_are_skipped(roots, instance, dcp_sample, step_dir, stack):
    place(dcp_sample("torchtitan").folder, roots.checkpoints, f"run/{step_dir}")

    result = tick(instance, roots.settings(settle_seconds=0))

    assert requested(result) == []
    assert result.skip_reason.skip_message.startswith(
        f"not watched: {roots.checkpoints / 'run' / step_dir}: skipped: {stack}"
    )


@pytest.mark.parametrize(
    "key", ["run/step-010", "run/checkpoint-٣", "run/step_1", "run/step-1/policy", "run/global_step2/actor"]
)
def test_partition_keys_of_other_stacks_name_only_their_folders(key):
    with pytest.raises(MergeError, match="is not <run_name>/global_step_<N>/<actor"):
        checkpoint_key(key)


def test_the_settings_hf_model_path_lets_the_sensors_run_merge_a_checkpoint_without_config(
    capsys, tmp_path, roots, instance, dcp_sample
):
    """torchtitan saves no config: the sensor's run (no run config) takes it from the settings."""
    titan = dcp_sample("torchtitan")
    folder = place(titan.folder, roots.checkpoints, "titan/step-10")
    settings = roots.settings(settle_seconds=0, hf_model_path=str(titan.original_dir))
    assert requested(tick(instance, settings)) == ["titan/step-10"]

    assert not materialize(instance, roots.settings(settle_seconds=0), "titan/step-10").success  # needs it
    assert materialize(instance, settings, "titan/step-10").success

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", folder, "--target_dir", tmp_path / "cli", "--hf_model_path", titan.original_dir
    )
    assert code == 0, err
    by_sensor, by_cli = load_safetensors_dir(roots.target("titan/step-10")), load_safetensors_dir(tmp_path / "cli")
    assert by_sensor.keys() == by_cli.keys() and by_cli
    assert all(same_bits(by_sensor[name], by_cli[name]) for name in by_cli)


def test_megatron_lm_iterations_are_partitions_merged_as_the_cli_merges_them(
    capsys, tmp_path, roots, instance, megatron_lm_sample
):
    """Megatron-LM's --save folder under a watched root: each iter_<N>/ is one partition, offered once
    the tracker beside it names N, and merged with the settings' hf_model_path (Megatron-LM saves no HF
    config) to the same bits as the CLI's merge of that folder, which are the model's."""
    save = place(megatron_lm_sample.role_dir, roots.checkpoints, "mlm/save")
    key, iteration = "mlm/save/iter_0000100", save / "iter_0000100"
    settings = roots.settings(settle_seconds=3600, hf_model_path=str(megatron_lm_sample.original_dir))
    (save / TRACKER).write_text("90")  # rank 0 writes 100 once every rank has saved iteration 100

    first = tick(instance, settings)
    assert requested(first) == []
    assert f"{key} ({TRACKER} says 90; a file changed" in first.skip_reason.skip_message

    (save / TRACKER).write_text("100")
    second = tick(instance, settings, first.cursor)
    assert requested(second) == [key]
    assert {e.partition: e.metadata["completeness"].value for e in second.asset_events} == {
        key: f"{TRACKER} says 100 >= 100"
    }
    assert [e.metadata["stack"].value for e in second.asset_events] == ["Megatron-LM"]
    assert settings.role_dir(checkpoint_key(key)) == iteration and checkpoint_key(key).step == 100

    assert materialize(instance, settings, key).success
    flags = ("--hf_model_path", megatron_lm_sample.original_dir)
    code, _, err = run_cli(capsys, "merge", "--local_dir", iteration, "--target_dir", tmp_path / "cli", *flags)
    assert code == 0, err
    by_sensor, by_cli = load_safetensors_dir(roots.target(key)), load_safetensors_dir(tmp_path / "cli")
    assert by_sensor.keys() == by_cli.keys() and by_cli
    assert all(same_bits(by_sensor[name], by_cli[name]) for name in by_cli)
    assert_bit_exact(roots.target(key), megatron_lm_sample.reference_dir)
