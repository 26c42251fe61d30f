"""A Mamba hybrid (Nemotron-H): megatron-core's hybrid model saves each layer under its own index, its type in its
names (``mixer.*`` Mamba, ``self_attention.*``, ``mlp.*``, ``mlp.router`` / ``mlp.experts`` MoE), and config.json's
layer pattern (``layers_block_type``, or the Hub's older ``hybrid_override_pattern``) gives each index a type: a
checkpoint whose layer disagrees is one line; Mamba's fused ``in_proj`` is its named parts in order, and a part
missing is one line. The whole model is proven against the bridge's own export in ``test_bridge_architectures.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.megatron import names

CONFIG = {
    "architectures": ["NemotronHForCausalLM"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_size": 32,
    "layers_block_type": ["mamba", "attention", "mlp"],
}
IN_PROJ = {"z": 16, "x": 16, "B": 8, "C": 8, "dt": 2}  # d_inner 16, 2 groups of state 4, 2 heads
MAMBA = {f"decoder.layers.0.mixer.in_proj.weight.{part}": (rows, 32) for part, rows in IN_PROJ.items()}
LAYERS = {
    **MAMBA,
    "decoder.layers.1.self_attention.linear_proj.weight": (32, 32),
    "decoder.layers.2.mlp.linear_fc2.weight": (32, 64),
}


def mapped(shapes: dict[str, tuple[int, ...]], **config) -> dict[str, list[tuple[str, tuple[int, int]]]]:
    model = names.model_shape({**CONFIG, **config}, Path("config.json"), value_model=False)
    specs = names.KeyMapper(shapes, model, Path("config.json"), Path("metadata.json")).outputs()
    return {s.name: [(p.key, p.rows) for p in s.pieces] for s in specs}


def test_mamba_in_proj_is_its_parts_in_order_and_each_layer_keeps_its_index():
    out = mapped(LAYERS)
    assert out["backbone.layers.0.mixer.in_proj.weight"] == [
        (f"decoder.layers.0.mixer.in_proj.weight.{part}", (0, rows)) for part, rows in IN_PROJ.items()
    ]
    assert set(out) == {
        "backbone.layers.0.mixer.in_proj.weight",
        "backbone.layers.1.mixer.o_proj.weight",
        "backbone.layers.2.mixer.down_proj.weight",
    }


def test_the_hubs_older_hybrid_override_pattern_says_the_same():
    pattern = {"layers_block_type": None, "hybrid_override_pattern": "M*-"}
    assert mapped(LAYERS, **pattern) == mapped(LAYERS)


def test_a_layer_of_another_type_than_the_pattern_says_is_one_line():
    with pytest.raises(
        MergeError,
        match=r"^config.json: layer 1 is mlp in the layer pattern \(3 layers\), the checkpoint holds attention "
        r"\(decoder.layers.1.self_attention.linear_proj.weight\)$",
    ):
        mapped(LAYERS, layers_block_type=["mamba", "mlp", "mlp"])


def test_a_missing_part_of_the_fused_in_proj_is_one_line():
    shapes = {k: v for k, v in LAYERS.items() if not k.endswith(".dt")}
    with pytest.raises(
        MergeError,
        match=r"^metadata.json: backbone.layers.0.mixer.in_proj.weight: the checkpoint holds the parts B, C, x, z, "
        r"not z, x, B, C, dt$",
    ):
        mapped(shapes)
