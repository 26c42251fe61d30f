"""The architecture check judges a name as ``from_pretrained`` loads it (``hf/load_names.py``), not only as
transformers 5 would save it: for kimi_k25 the two differ (saving undoes ``blocks`` -> ``layers``
everywhere, so it would write ``language_model.model.blocks.N``; loading takes the Hub's ``layers.N``).
A name loading puts nowhere, a wrong shape, and two names for one tensor are still refused."""

from __future__ import annotations

import re

import pytest
import transformers

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.architecture import check_plan_against_architecture, expected_tensors
from merge_pipeline.plan import Computed, PlannedTensor


def planned(shapes: dict[str, tuple[int, ...]]) -> list[PlannedTensor]:
    return [PlannedTensor(name, shape, None, Computed(lambda: None)) for name, shape in shapes.items()]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """A tiny Kimi-K2.5 (DeepSeek-V3 text model, MoonViT tower) as transformers 5.24 configures it."""
    folder = tmp_path_factory.mktemp("kimi_k25")
    text = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1,
    )  # fmt: skip
    vision = dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=48, patch_size=14)
    config = transformers.AutoConfig.for_model("kimi_k25", text_config=text, vision_config=vision)
    config.architectures = ["Kimi_K25ForConditionalGeneration"]
    config.save_pretrained(folder)
    return folder, expected_tensors(folder, value_model=False, trust_remote_code=False)


def hub_names(expected) -> dict[str, tuple[int, ...]]:
    """The names Kimi-K2.5's own checkpoint uses: its language model's layers are ``layers``."""
    return {
        re.sub(r"^language_model\.model\.blocks\.", "language_model.model.layers.", k): v for k, v in expected.items()
    }


def refusal(folder, shapes, expected) -> str:
    with pytest.raises(MergeError) as error:
        check_plan_against_architecture(planned(shapes), expected, folder / "config.json")
    assert error.value.path == folder / "config.json" and "\n" not in str(error.value)
    return str(error.value)


def test_kimi_hub_names_pass_and_so_do_the_reversals_own(kimi):
    folder, expected = kimi
    hub = hub_names(expected)
    assert "language_model.model.blocks.1.mlp.experts.0.gate_proj.weight" in expected
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in hub  # through the experts' converter
    assert "language_model.model.layers.0.self_attn.o_proj.weight" in hub
    check_plan_against_architecture(planned(hub), expected, folder / "config.json")
    check_plan_against_architecture(planned(expected), expected, folder / "config.json")


def test_kimi_wrong_name_wrong_shape_and_a_double_are_refused(kimi):
    folder, expected = kimi
    hub = hub_names(expected)
    wrong = dict(hub)
    wrong["language_model.model.layers.0.self_attn.out_proj.weight"] = wrong.pop(
        "language_model.model.layers.0.self_attn.o_proj.weight"
    )
    message = refusal(folder, wrong, expected)
    assert "1 unexpected" in message and "layers.0.self_attn.out_proj.weight" in message, message
    assert "1 missing: language_model.model.blocks.0.self_attn.o_proj.weight" in message, message

    reshaped = {**hub, "language_model.model.layers.0.self_attn.o_proj.weight": (64, 63)}
    assert "language_model.model.layers.0.self_attn.o_proj.weight (64, 63) vs (64, 64)" in refusal(
        folder, reshaped, expected
    )
    expert = "language_model.model.layers.1.mlp.experts.0.gate_proj.weight"
    assert f"{expert} (31, 64) vs (32, 64)" in refusal(folder, {**hub, expert: (31, 64)}, expected)

    both = {
        **hub,
        "language_model.model.blocks.0.self_attn.o_proj.weight": hub[
            "language_model.model.layers.0.self_attn.o_proj.weight"
        ],
    }
    message = refusal(folder, both, expected)
    assert (
        "1 pairs of names for one tensor: language_model.model.layers.0.self_attn.o_proj.weight and language_model.model.blocks.0.self_attn.o_proj.weight"
        in message
    ), message
