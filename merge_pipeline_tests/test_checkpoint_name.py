"""One name per checkpoint: the readers' step folders name it, for the partition key, the manifest, the model
card and the Hub branch alike (a torchtitan ``step-10`` is published on branch ``step-10``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.dagster.hub_model import HuggingFaceHub
from merge_pipeline.formats import checkpoint_name
from merge_pipeline.hub.model_card import render_card
from merge_pipeline.watch.partitions import checkpoint_key

FOLDERS = [
    # folder, its name, its writer
    ("/ckpts/ppo/global_step_7/actor", "ppo/global_step_7/actor", "verl"),
    ("/ckpts/sft/global_step_7", "sft/global_step_7", "verl"),
    ("/ckpts/llama3/step-10", "llama3/step-10", "torchtitan"),
    ("/ckpts/gpt/iter_0000100", "gpt/iter_0000100", "Megatron-LM"),
    ("/ckpts/grpo/step_3/policy", "grpo/step_3/policy", "NeMo-RL"),
    ("/ckpts/ds/global_step12", "ds/global_step12", "DeepSpeed"),
    ("/ckpts/trainer/checkpoint-500", "trainer/checkpoint-500", "the HF Trainer"),
]


@pytest.mark.parametrize(("folder", "key", "writer"), FOLDERS)
def test_a_folder_and_its_partition_key_are_one_name(folder, key, writer):
    name = checkpoint_name(Path(folder))
    assert checkpoint_key(key) == name and str(name) == key and name.path.as_posix() == key
    assert name.writer == writer


def test_a_folder_in_no_step_folder_is_named_by_its_role_alone():
    assert checkpoint_name(Path("/somewhere/my_export")) == CheckpointName("my_export")


@pytest.mark.parametrize(
    ("key", "branch"), [("llama3/step-10", "step-10"), ("ppo/global_step_7/actor", "global_step_7")]
)
def test_the_hub_branch_is_the_step_folder_as_the_trainer_names_it(key, branch):
    hub = HuggingFaceHub(organization="org", revisions="branch")
    assert hub.revision(checkpoint_key(key)) == branch
    assert HuggingFaceHub(organization="org", revisions="commit").revision(checkpoint_key(key)) is None


def test_the_model_card_names_the_checkpoint_and_its_writer():
    name = checkpoint_name(Path("/ckpts/llama3/step-10"))
    manifest = {
        "tool": {"name": "merge_pipeline", "version": "0"},
        "source": {
            "backend": "dcp",
            "role_dir": "/ckpts/llama3/step-10",
            "role": name.role,
            "layout": {},
            "checkpoint": {**name.__dict__},
        },
        "decisions": {"config_dtype": "bfloat16"},
        "options": {"dtype": "auto"},
        "parameters": 1,
        "files": {},
    }
    card = render_card(manifest, "org/llama3")
    assert "Merged from the torchtitan dcp checkpoint `llama3/step-10`" in card
    assert "- torchtitan\n" in card and "| step | 10 |" in card
    old = {**manifest, "source": {k: v for k, v in manifest["source"].items() if k != "checkpoint"}}
    assert "| step | not recorded |" in render_card(old, "org/llama3")  # merged before names were recorded
