"""Each reader's step folders and completeness rules, on small synthetic folders (no checkpoint written)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from merge_pipeline.formats import READERS, completeness, reader, saved_in_step_folder, step_folder, step_folders
from merge_pipeline.formats.megatron.lm_save import MEGATRON_LM_STEPS
from merge_pipeline.formats.step_folders import HF_TRAINER, TRACKER, VERL
from merge_pipeline.hf.config import CheckpointConfig
from merge_pipeline.options import MergeOptions


def touch(path: Path, text: str = "x") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def reason(folder: Path, step: int, *, now: float | None = None) -> tuple[bool, str]:
    """The answer an hour after the files were written (past the settle time), or at ``now``."""
    state = completeness(folder, step, 60, now=time.time() + 3600 if now is None else now)
    return state.complete, state.reason


def test_every_step_folder_is_some_readers_and_no_name_is_two_stacks():
    declared = [folder for name in READERS for folder in reader(name).step_folders]
    assert set(step_folders()) == set(declared) and len(step_folders()) == len(set(declared))
    assert all(step_folder(folder.folder_name(3)) == (folder, 3) for folder in step_folders())
    names = ["global_step_3", "global_step3", "checkpoint-3", "step-3", "step_3", "iter_0000003"]
    stacks = ["verl", "DeepSpeed", "the HF Trainer", "torchtitan", "NeMo-RL", "Megatron-LM"]
    assert [step_folder(n)[0].stack for n in names] == stacks
    # Megatron-LM pads to 7 digits and no further: iter_0000003 and iter_12345678 are its names, iter_3 is not
    assert step_folder("iter_12345678") == (MEGATRON_LM_STEPS, 12345678)
    odd = ("global_step_03", "step-٣", "steps-3", "iter_3", "iter_00000003", "iter_000000٣")
    assert [step_folder(n) for n in odd] == [None] * len(odd)


def test_a_step_folder_holds_a_save_by_its_readers_rule(tmp_path):
    sft = tmp_path / "global_step_3"
    assert not saved_in_step_folder(sft, VERL)
    touch(sft / "model_world_size_1_rank_0.pt")
    assert saved_in_step_folder(sft, VERL)
    tag = tmp_path / "ds" / "global_step3"
    tag.mkdir(parents=True)
    deepspeed_tag = step_folder(tag.name)[0]
    assert not saved_in_step_folder(tag, deepspeed_tag)
    touch(tag.parent / "latest", "global_step3")
    assert saved_in_step_folder(tag, deepspeed_tag)
    trainer = tmp_path / "checkpoint-3"
    trainer.mkdir()
    assert not saved_in_step_folder(trainer, HF_TRAINER)
    (trainer / "pytorch_model_fsdp_0").mkdir()
    assert saved_in_step_folder(trainer, HF_TRAINER)
    assert saved_in_step_folder(tmp_path / "step-3", step_folder("step-3")[0])  # torchtitan's is the DCP folder
    iteration = tmp_path / "save" / "iter_0000003"
    iteration.mkdir(parents=True)
    assert not saved_in_step_folder(iteration, MEGATRON_LM_STEPS)
    touch(iteration / ".metadata")  # Megatron-LM's iteration folder is the dist checkpoint
    assert saved_in_step_folder(iteration, MEGATRON_LM_STEPS)


def test_verl_completeness_tracker_manifest_and_settle_time(tmp_path):
    actor = tmp_path / "run" / "global_step_3" / "actor"
    assert reason(actor, 3) == (False, "no files yet")
    touch(actor / "model_world_size_1_rank_0.pt")
    assert reason(actor, 3) == (True, f"no {TRACKER}; no file changed for 3600 s (settle time 60 s)")
    assert reason(actor, 3, now=time.time())[0] is False  # just written: not settled
    touch(tmp_path / "run" / TRACKER, "2")
    assert reason(actor, 3, now=time.time())[1].startswith(f"{TRACKER} says 2; a file changed")
    (actor / "model" / "dist_ckpt").mkdir(parents=True)  # Megatron layout v2 without its manifest
    assert reason(actor, 3) == (
        False,
        "Megatron layout v2 without ckpt_contents.json: verl writes it last, the save is not finished",
    )
    touch(tmp_path / "run" / TRACKER, "3")
    assert reason(actor, 3) == (True, f"{TRACKER} says 3 >= 3")
    touch(actor / "ckpt_contents.json", "{}")
    assert reason(actor, 3) == (True, "ckpt_contents.json present (verl writes it last)")


def earlier(path: Path) -> Path:
    """``path`` as an earlier run left it: last written ten minutes ago."""
    then = time.time() - 600
    os.utime(path, (then, then))
    return path


def test_a_tracker_written_before_the_steps_last_change_does_not_skip_the_settle_time(tmp_path):
    """An earlier run's tracker says 5 while step 3 is being saved again: it vouches for nothing."""
    actor, iteration, v2 = (
        tmp_path / "verl" / "global_step_3" / "actor",
        tmp_path / "megatron_lm" / "iter_0000003",
        tmp_path / "verl_v2" / "global_step_3" / "actor",
    )
    for folder, tracker in [
        (actor, tmp_path / "verl" / TRACKER),
        (iteration, tmp_path / "megatron_lm" / TRACKER),
        (v2, tmp_path / "verl_v2" / TRACKER),
    ]:
        earlier(touch(tracker, "5"))
        touch(folder / "model" / "dist_ckpt" / "__0_0.distcp" if folder is v2 else folder / ".metadata")
    stale = f"{TRACKER} says 5 >= 3, but was written before the step's last change (an earlier run's?)"

    assert reason(actor, 3, now=time.time()) == (False, f"{stale}; a file changed 0 s ago (settle time 60 s)")
    assert reason(actor, 3) == (True, f"{stale}; no file changed for 3600 s (settle time 60 s)")
    assert reason(iteration, 3, now=time.time()) == (False, f"{stale}; a file changed 0 s ago (settle time 60 s)")
    # verl's Megatron layout v2 is finished by its manifest: quiet or not, a stale tracker does not stand in for it
    assert reason(v2, 3) == (
        False,
        "Megatron layout v2 without ckpt_contents.json: verl writes it last, the save is not finished",
    )
    for folder, tracker in [(actor, tmp_path / "verl" / TRACKER), (v2, tmp_path / "verl_v2" / TRACKER)]:
        touch(tracker, "5")  # written after the save: it speaks for it
        assert reason(folder, 3, now=time.time()) == (True, f"{TRACKER} says 5 >= 3")


def test_megatron_lm_completeness_follows_its_tracker(tmp_path):
    iteration = tmp_path / "save" / "iter_0000300"
    touch(iteration / ".metadata")
    assert reason(iteration, 300, now=time.time()) == (
        False,
        f"no {TRACKER}; a file changed 0 s ago (settle time 60 s)",
    )
    touch(iteration.parent / TRACKER, "200")  # written after every rank's save: iteration 300 is still being saved
    assert reason(iteration, 300, now=time.time())[1].startswith(f"{TRACKER} says 200; a file changed")
    touch(iteration.parent / TRACKER, "300")
    assert reason(iteration, 300, now=time.time()) == (True, f"{TRACKER} says 300 >= 300")


def test_dcp_completeness_metadata_then_settle_time(tmp_path):
    for folder in (tmp_path / "tt" / "step-3", tmp_path / "nemo" / "step_3" / "policy"):
        touch(folder / "__0_0.distcp")
        assert reason(folder, 3) == (
            False,
            "DCP: no .metadata yet (dcp.save's coordinator writes it after every rank's data)",
        )
        touch((folder / "weights" if folder.name == "policy" else folder) / ".metadata")
        assert reason(folder, 3)[1].startswith("DCP: .metadata present")


def test_deepspeed_completeness_follows_latest(tmp_path):
    save_dir = tmp_path / "ds"
    tag = save_dir / "global_step3"
    touch(tag / "mp_rank_00_model_states.pt")
    assert reason(tag, 3) == (
        False,
        "DeepSpeed: latest names nothing, not global_step3 yet (DeepSpeed writes it after every rank's files)",
    )
    touch(save_dir / "latest", "global_step3")
    assert reason(tag, 3)[1].startswith("DeepSpeed: latest names this tag; the model states do not say")
    touch(save_dir / "latest", "global_step5")  # a later tag: this one was finished before it
    assert reason(tag, 3)[1].startswith("DeepSpeed: latest names the later tag global_step5")


def test_the_hf_trainers_folder_is_judged_by_what_it_holds(tmp_path):
    deepspeed_dir, accelerate_dir = tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3"
    touch(deepspeed_dir / "latest", "global_step3")
    touch(deepspeed_dir / "global_step3" / "mp_rank_00_model_states.pt")
    assert reason(deepspeed_dir, 3)[1].startswith("DeepSpeed: latest names this tag")
    touch(accelerate_dir / "pytorch_model_fsdp_0" / "__0_0.distcp")
    assert reason(accelerate_dir, 3)[1].startswith("DCP: no .metadata yet")


def test_the_model_config_is_read_once_for_a_checkpoint(tmp_path):
    config_path = touch(tmp_path / "actor" / "huggingface" / "config.json", '{"model_type": "qwen2"}')
    config = CheckpointConfig.of(tmp_path / "actor", MergeOptions())
    first = config.load(None)
    config_path.unlink()  # read again, it would be missing
    assert config.load(None) is first and first.raw == {"model_type": "qwen2"}


@pytest.mark.parametrize("name", READERS)
def test_each_reader_answers_only_for_its_own_step_folders(name, tmp_path):
    found = reader(name)
    assert all(folder in step_folders() for folder in found.step_folders)
    if not found.step_folders:  # a format no watched trainer writes: never asked
        assert found.completeness(tmp_path, 1, VERL, None) is None
