"""Gemma 4's attention, saved per layer type by the bridge (``self_attention_sliding.*``, ``self_attention_global.*``,
each stacking its own layers' copies): each copy goes to the layer ``layer_types`` says, split by that type's
sizes; a checkpoint that stacks another number of layers than the config names is one line. The whole model is
proven against the bridge's own export in ``test_bridge_architectures.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.megatron import names

CONFIG = {
    "architectures": ["Gemma4ForCausalLM"],
    "enable_moe_block": False,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "global_head_dim": 16,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}


def mapped(shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[str, int, tuple[int, int]]]]:
    model = names.model_shape(CONFIG, Path("config.json"), value_model=False)
    specs = names.KeyMapper(shapes, model, Path("config.json"), Path("metadata.json")).outputs()
    return {s.name: [(p.key, *p.index, p.rows) for p in s.pieces] for s in specs}


def test_each_layer_types_copies_go_to_its_layers_split_by_its_sizes():
    sliding_qkv = 2 * (2 * 8 + 2 * 8)  # 2 KV groups of 2 q heads, k, v, 8 wide
    global_qkv = 2 * (2 * 16 + 2 * 16)
    out = mapped(
        {
            "decoder.layers.self_attention_sliding.linear_qkv.weight": (2, sliding_qkv, 32),
            "decoder.layers.self_attention_global.linear_qkv.weight": (1, global_qkv, 32),
        }
    )
    sliding, full = (f"decoder.layers.self_attention_{kind}.linear_qkv.weight" for kind in ("sliding", "global"))
    # layer 2 is the second sliding layer; layer 1 the full-attention one, its heads 16 wide
    assert out["model.layers.2.self_attn.k_proj.weight"] == [(sliding, 1, (16, 24)), (sliding, 1, (48, 56))]
    assert out["model.layers.1.self_attn.k_proj.weight"] == [(full, 0, (32, 48)), (full, 0, (96, 112))]
    assert len(out) == 9  # q, k, v of three layers


def test_a_checkpoint_stacking_other_layers_than_layer_types_is_one_line():
    with pytest.raises(
        MergeError, match=r"^config.json: layer_types has 1 full_attention layer\(s\), the checkpoint's "
    ):
        mapped({"decoder.layers.self_attention_global.linear_proj.weight": (2, 32, 64)})
