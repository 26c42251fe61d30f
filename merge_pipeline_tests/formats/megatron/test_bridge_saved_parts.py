"""Gated DeltaNet's in_proj and conv1d, which megatron-core saves in parts (``<name>.query``, ``.key``, ...): a
checkpoint whose parts are not those the bridge's mapping builds its HF tensors from is one line naming them, and
the per-key-head layout needs ``linear_num_key_heads`` (fast; the merges themselves are proven bit for bit in
``test_bridge_architectures.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.megatron import names

CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    hidden_size=64,
    num_hidden_layers=1,
    linear_num_key_heads=4,
)
LAYER = "decoder.layers.0.self_attention."
IN_PROJ = {
    f"{LAYER}in_proj.weight.{part}": (rows, 64)
    for part, rows in (("query", 64), ("key", 64), ("value", 128), ("z", 128), ("beta", 8), ("alpha", 8))
}


def outputs(shapes: dict, **config) -> list:
    model = names.model_shape({**CONFIG, **config}, Path("config.json"), value_model=False)
    return names.KeyMapper(shapes, model, Path("config.json"), Path("metadata.json")).outputs()


def test_in_proj_parts_become_qwen3_nexts_fused_tensors_per_key_head():
    specs = {spec.name: spec for spec in outputs(IN_PROJ)}
    qkvz = specs["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert [p.key.rpartition(".")[2] for p in qkvz.pieces[:4]] == ["query", "key", "value", "z"]
    assert len(qkvz.pieces) == 4 * 4 and qkvz.pieces[4].rows == (16, 32)  # key head 1's query rows after head 0's
    assert sorted(specs) == [
        "model.layers.0.linear_attn.in_proj_ba.weight",
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
    ]


def test_a_missing_part_is_one_line_naming_it():
    shapes = {k: v for k, v in IN_PROJ.items() if not k.endswith(".alpha")}
    with pytest.raises(
        MergeError,
        match=r"^metadata.json: model.layers.0.linear_attn.in_proj_ba.weight: the checkpoint holds the parts beta, "
        r"not beta, alpha$",
    ):
        outputs(shapes)


def test_per_key_head_parts_need_linear_num_key_heads():
    with pytest.raises(
        MergeError,
        match=r"^config.json: model.layers.0.linear_attn.in_proj_\w+.weight: linear_num_key_heads is missing$",
    ):
        outputs(IN_PROJ, linear_num_key_heads=None)
