"""The family records (``merge_pipeline/families.py``): each lookup finds exactly one record."""

from __future__ import annotations

from collections import Counter

import pytest

from merge_pipeline import families
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.torchtitan_names import torchtitan_outputs


def test_each_architecture_and_model_type_names_one_family():
    architectures = Counter(a for f in families.FAMILIES.values() for a in f.architectures)
    model_types = Counter(f.model_type for f in families.FAMILIES.values())
    assert [a for a, n in architectures.items() if n > 1] == []
    assert [m for m, n in model_types.items() if n > 1] == []
    for name, family in families.FAMILIES.items():
        assert family.name == name
        assert families.by_model_type(family.model_type) is family
        assert all(families.by_architecture(a) is family for a in family.architectures)


def test_a_torchtitan_name_has_one_meaning():
    """A stored name is renamed, split per expert, transposed per expert, fused with others or refused:
    never two of these."""
    for family in families.FAMILIES.values():
        names = family.torchtitan
        if names is None:
            continue
        fused = [part for parts in (*names.fused_layer.values(), *names.fused_vision.values()) for part in parts]
        kinds = [
            *names.layer,
            *names.grouped_experts,
            *names.transposed_experts,
            *fused,
            *names.refused,
            *names.vision,
        ]
        assert [k for k, n in Counter(kinds).items() if n > 1] == [], family.name


def test_a_refused_torchtitan_name_is_one_line_naming_it(tmp_path):
    """qwen3_5-MoE's grouped experts (its to_hf transposes them and fuses gate and up) are refused at
    plan time, naming the key; torchtitan's qwen3_5 debug flavor, the fixture, has no MoE layer."""
    key = "layers.0.moe.routed_experts.inner_experts.w1_EFD"
    config = {"model_type": "qwen3_5_moe", "num_attention_heads": 4, "num_hidden_layers": 1}
    with pytest.raises(MergeError) as raised:
        torchtitan_outputs({key: (4, 8, 16)}, config, tmp_path / "config.json", tmp_path / ".metadata")
    assert raised.value.path == tmp_path / ".metadata"
    assert raised.value.problem.startswith(f"{key}: its to_hf transposes the grouped experts"), raised.value.problem
