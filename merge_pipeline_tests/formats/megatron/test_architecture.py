"""The architecture check: transformers' meta-device model is the judge of names and shapes."""

from __future__ import annotations

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.architecture import check_plan_against_architecture, expected_tensors
from merge_pipeline.plan import Computed, PlannedTensor


def planned(shapes: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    return [PlannedTensor(name, shape, None, Computed(lambda: None)) for name, shape in shapes.items()]


@pytest.fixture(scope="module")
def tied_llama(megatron_samples):
    hf_dir = megatron_samples["llama_tied_pp2"].role_dir / "huggingface"
    return hf_dir, expected_tensors(hf_dir, value_model=False, trust_remote_code=False)


def test_tied_lm_head_may_be_present_or_absent(tied_llama):
    hf_dir, expected = tied_llama
    assert {"lm_head.weight", "model.embed_tokens.weight"} in expected.tied_groups
    check_plan_against_architecture(planned(expected), expected, hf_dir / "config.json")
    without_head = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    check_plan_against_architecture(planned(without_head), expected, hf_dir / "config.json")


def test_every_problem_is_listed_in_one_line(tied_llama):
    hf_dir, expected = tied_llama
    shapes = dict(expected)
    del shapes["model.layers.0.mlp.up_proj.weight"]
    shapes["model.layers.0.mlp.extra.weight"] = (1, 1)
    shapes["model.norm.weight"] = (3,)
    with pytest.raises(MergeError) as error:
        check_plan_against_architecture(planned(shapes), expected, hf_dir / "config.json")
    message = str(error.value)
    assert "\n" not in message and error.value.path == hf_dir / "config.json"
    assert "1 unexpected" in message and "model.layers.0.mlp.extra.weight" in message
    assert "1 missing: model.layers.0.mlp.up_proj.weight" in message
    assert "model.norm.weight (3,) vs (64,)" in message


def test_moe_experts_are_expected_per_expert_as_on_the_hub(megatron_samples):
    """transformers 5 fuses experts in memory; the files keep one tensor per expert."""
    expected = expected_tensors(
        megatron_samples["qwen2_moe_ep2"].role_dir / "huggingface", value_model=False, trust_remote_code=False
    )
    assert expected["model.layers.0.mlp.experts.3.gate_proj.weight"] == (32, 64)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in expected


def test_value_model_expects_a_score_head(megatron_samples):
    expected = expected_tensors(
        megatron_samples["qwen2_value"].role_dir / "huggingface", value_model=True, trust_remote_code=False
    )
    assert expected["score.weight"] == (1, 64) and "lm_head.weight" not in expected


def test_mtp_layer_is_expected_whole_or_not_at_all(megatron_samples):
    """DeepSeek-V3's config keeps ``num_nextn_predict_layers`` whether or not the run trained MTP:
    a checkpoint without the MTP layer is fine, one with part of it is not."""
    hf_dir = megatron_samples["deepseek_v3_mtp"].role_dir / "huggingface"
    expected = expected_tensors(hf_dir, value_model=False, trust_remote_code=False)
    mtp_layer = {name for name in expected if name.startswith("model.layers.2.")}
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight"} <= mtp_layer
    assert expected["model.layers.2.eh_proj.weight"] == (64, 128)
    check_plan_against_architecture(planned(expected), expected, hf_dir / "config.json")
    without_mtp = {k: v for k, v in expected.items() if k not in mtp_layer}
    check_plan_against_architecture(planned(without_mtp), expected, hf_dir / "config.json")
    partial = {k: v for k, v in expected.items() if k != "model.layers.2.eh_proj.weight"}
    with pytest.raises(MergeError, match="1 missing: model.layers.2.eh_proj.weight"):
        check_plan_against_architecture(planned(partial), expected, hf_dir / "config.json")


def test_a_tied_head_saved_under_another_name_may_be_absent(tmp_path):
    """Gemma 3 VL keeps ``lm_head.weight`` in memory and saves it as ``language_model.lm_head.weight``: that
    name is tied to the saved embedding too, so a checkpoint without it (the bridge's export) passes."""
    import transformers

    text = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, head_dim=8
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    transformers.Gemma3Config(text_config=text, vision_config=vision, tie_word_embeddings=True).save_pretrained(
        tmp_path
    )
    expected = expected_tensors(tmp_path, value_model=False, trust_remote_code=False)
    tied = {"language_model.lm_head.weight", "language_model.model.embed_tokens.weight"}
    assert tied in expected.tied_groups
    without_head = {k: v for k, v in expected.items() if k != "language_model.lm_head.weight"}
    check_plan_against_architecture(planned(without_head), expected, tmp_path / "config.json")
