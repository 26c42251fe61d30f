"""The hand-written Megatron families (``merge_pipeline/families.py`` with ``formats/megatron/names.py``) map
every Megatron name the bridge maps to the bridge's own HF names, by the same operation: for each mapping
in ``merge_pipeline/bridge_mappings.json`` (generated from Megatron-Bridge's ``mapping_registry()``) of an
architecture a family covers, the name with its wildcards filled in (layer 1, expert 1) goes through the
reader's ``KeyMapper`` and must come out as the bridge's HF names. The differences that stand are listed
with their reason; a new one fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline import families
from merge_pipeline.formats.megatron import bridge_table, names

_CONFIG = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32, num_hidden_layers=2)
_ROWS = {"qkv": 2 * (2 * 8 + 2 * 8), "gate_up": 32}  # 2 KV groups of 2 q heads + k + v; gate + up

# Bridge mappings the hand families do not follow, and why.
_QWEN3_MTP = (
    "Qwen3's bridge names MTP layers mtp.* (Qwen3.5's layout), which transformers' Qwen3 does not load; "
    "the reader maps mtp.layers.<k> as DeepSeek-V3's layers num_hidden_layers + k"
)
KNOWN_DIFFERENCES = {
    ("Qwen3ForCausalLM", "mtp."): _QWEN3_MTP,
    ("Glm4MoeForCausalLM", "decoder.layers.*.mlp.shared_experts.router.weight"): (
        "megatron-core's shared experts have no router (their gate is shared_experts.gate_weight): "
        "the bridge's mapping names no parameter the model builds"
    ),
    ("Qwen2_5_VLForConditionalGeneration", "visual.**"): (
        "the bridge's Qwen2.5-VL keeps transformers' vision tower as is (visual.*); the family maps "
        "megatron-core's own vision model (vision_model.*), which verl's non-bridge path saves"
    ),
}
# TransformerEngine's grouped experts in memory (experts.linear_fc1.weight<N>): megatron-core 0.18.2's
# TEGroupedMLP.sharded_state_dict saves them with a global expert axis, "interchangeable with SequentialMLP's" (its
# source; not run: no TransformerEngine here), the layout the local_experts.* mapping covers.
_IN_MEMORY_ONLY = "weight*", "bias*"


def _known(architecture: str, megatron: str) -> bool:
    return any(a == architecture and megatron.startswith(p) for a, p in KNOWN_DIFFERENCES)


def _cases():
    for family in families.FAMILIES.values():
        for architecture in family.architectures:
            if family.megatron and architecture in bridge_table.architectures():
                yield pytest.param(architecture, id=architecture)


@pytest.mark.parametrize("architecture", list(_cases()))
def test_family_maps_as_the_bridge(architecture):
    config = {"architectures": [architecture], **_CONFIG, "vision_config": {"num_heads": 2}}
    shape = names.model_shape(config, Path("config.json"), value_model=False)
    differences = []
    for mapping in bridge_table.mappings(architecture):
        if _known(architecture, mapping.megatron) or mapping.megatron.endswith(_IN_MEMORY_ONLY):
            continue
        key = mapping.megatron.replace("*", "1")
        rows = _ROWS.get(mapping.operation, 16)
        shapes = {key: (rows,) if key.endswith(("bias", "softmax_offset")) else (rows, 32)}
        mapper = names.KeyMapper(shapes, shape, Path("config.json"), Path("metadata.json"))
        specs = mapper._map_key(key, shapes[key])
        got = None if specs is None else sorted(s.name for s in specs) or sorted(mapper.grouped)
        want = sorted(mapping.hf_names(key).values())
        if got != want:
            differences.append(f"{key} ({mapping.kinds[0]}): bridge {want}, reader {got}")
        elif mapping.operation == "gate_up":  # gate rows first, as GatedMLPMapping splits them
            gate = next(s for s in specs if s.name == mapping.hf_names(key)["gate"])
            assert gate.pieces[0].rows == (0, rows // 2)
        elif mapping.operation == "qkv":
            assert len(specs) == 3
    assert not differences, "\n".join(differences)


def test_known_differences_are_still_in_the_bridge():
    """A difference the bridge no longer has must leave the list."""
    for architecture, prefix in KNOWN_DIFFERENCES:
        assert any(m.megatron.startswith(prefix) for m in bridge_table.mappings(architecture)), (architecture, prefix)
