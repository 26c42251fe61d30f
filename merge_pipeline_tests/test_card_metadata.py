"""Which values the model card may publish as a base model: Hub ids only, never a path of this machine."""

from __future__ import annotations

import pytest

from merge_pipeline.hub.card_metadata import hub_id, pipeline_tag


@pytest.mark.parametrize("value", ["Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B", "org_1/model.v2"])
def test_a_hub_id_is_taken(value):
    assert hub_id(value) == value


@pytest.mark.parametrize(
    "value",
    [
        "/root/models/qwen",
        "./models/qwen",
        "~/models/qwen",
        "../qwen/x",
        "qwen",
        "a/b/c",
        "org/a..b",
        "org--x/y",
        "org/x.git",
        "",
        None,
        7,
    ],
)
def test_a_path_or_a_malformed_id_is_not(value):
    assert hub_id(value) is None


def test_an_id_shaped_path_that_is_a_folder_here_is_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_id("models/qwen") == "models/qwen"
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    assert hub_id("models/qwen") is None


@pytest.mark.parametrize(
    "architecture, tag",
    [
        ("Qwen2ForCausalLM", "text-generation"),
        ("GPT2LMHeadModel", "text-generation"),
        ("LlamaForTokenClassification", "token-classification"),
        ("Qwen2_5_VLForConditionalGeneration", None),
    ],
)
def test_the_task_comes_from_the_architecture(architecture, tag):
    assert pipeline_tag({"architectures": [architecture]}) == tag
    assert pipeline_tag({}) is None
    assert pipeline_tag({"architectures": {"0": architecture}}) is None  # a hand-edited config: no task, no error
