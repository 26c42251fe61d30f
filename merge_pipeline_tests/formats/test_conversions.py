"""The conversion vocabulary (``formats/conversions.py``) against torch's own tensor operations: the rows each
operation selects from a real stored tensor equal what the operation does to the whole tensor."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.added_one import AddedOne
from merge_pipeline.formats.conversions import (
    AddOne,
    Chunk,
    Concatenate,
    ConcatenateParts,
    GroupedExperts,
    PerExpert,
    PermuteForRope,
    RegroupQKV,
    Rename,
    Sizes,
    SplitQKV,
    Stored,
    Transpose,
    named,
)
from merge_pipeline.formats.output_specs import OutputSpec
from merge_pipeline.plan import Computed

SIZES = Sizes(Path("config.json"), Path("metadata.json"), attention_heads=4, kv_heads=2, head_dim=3, vision_heads=2)


def tensors(**shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    return {
        key: torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        for key, shape in shapes.items()
    }


def built(spec: OutputSpec, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The HF tensor a spec describes, from whole stored tensors (what the DCP planner reads as byte ranges)."""
    return torch.cat([stored[p.key][p.index][p.rows[0] : p.rows[1]] for p in spec.pieces])


def by_name(specs: list[OutputSpec], stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {spec.name: built(spec, stored) for spec in specs}


def test_rename_is_the_stored_tensor():
    stored = tensors(w=(2, 6, 4))
    got = by_name(Rename("o_proj.weight").outputs(Stored("w", (2, 6, 4), (1,)), SIZES), stored)
    assert torch.equal(got["o_proj.weight"], stored["w"][1])


def test_chunk_is_torch_chunk_in_two_and_an_odd_fc1_is_one_line():
    stored = tensors(fc1=(8, 4))
    got = by_name(Chunk("gate", "up").outputs(Stored("fc1", (8, 4)), SIZES), stored)
    gate, up = torch.chunk(stored["fc1"], 2)
    assert torch.equal(got["gate"], gate) and torch.equal(got["up"], up)
    with pytest.raises(MergeError, match=r"^metadata.json: fc1: gated fc1 has an odd number of rows \(7\)$"):
        Chunk("gate", "up").outputs(Stored("fc1", (7, 4)), SIZES)


def test_split_qkv_takes_each_kv_groups_q_heads_k_and_v():
    rows = SIZES.kv_heads * (SIZES.attention_heads // SIZES.kv_heads + 2) * SIZES.head_dim
    stored = tensors(qkv=(rows, 5))
    got = by_name(SplitQKV("q", "k", "v").outputs(Stored("qkv", (rows, 5)), SIZES), stored)
    groups = stored["qkv"].view(SIZES.kv_heads, -1, SIZES.head_dim, 5)  # [group, q heads + k + v, head_dim, cols]
    q, k, v = groups.split([SIZES.attention_heads // SIZES.kv_heads, 1, 1], dim=1)
    assert torch.equal(got["q"], q.reshape(-1, 5)) and torch.equal(got["k"], k.reshape(-1, 5))
    assert torch.equal(got["v"], v.reshape(-1, 5))
    with pytest.raises(MergeError, match=r"^config.json: sizes disagree with the checkpoint: qkv has 21 rows"):
        SplitQKV("q", "k", "v").outputs(Stored("qkv", (21, 5)), SIZES)


def test_split_qkv_with_an_output_gate_puts_each_heads_gate_rows_after_its_q_rows():
    # megatron-core's attention_output_gate: [q heads | gate heads | k | v] per KV group; HF's q_proj (Qwen3-Next,
    # Qwen3.5) is viewed as [heads, 2 x head_dim] and chunked into q and gate: each head's q rows, then its gate's.
    per_group = SIZES.attention_heads // SIZES.kv_heads
    rows = SIZES.kv_heads * (2 * per_group + 2) * SIZES.head_dim
    stored = tensors(qkv=(rows, 5))
    got = by_name(SplitQKV("q", "k", "v", output_gate=True).outputs(Stored("qkv", (rows, 5)), SIZES), stored)
    groups = stored["qkv"].view(SIZES.kv_heads, -1, SIZES.head_dim, 5)
    q, gate, k, v = groups.split([per_group, per_group, 1, 1], dim=1)
    assert torch.equal(got["q"], torch.cat([q, gate], dim=2).reshape(-1, 5))
    assert torch.equal(got["k"], k.reshape(-1, 5)) and torch.equal(got["v"], v.reshape(-1, 5))
    with pytest.raises(MergeError, match=r"^config.json: sizes disagree with the checkpoint: qkv has 36 rows"):
        SplitQKV("q", "k", "v").outputs(Stored("qkv", (rows, 5)), SIZES)  # a family whose model has no gate


def test_regroup_qkv_puts_every_heads_q_first_then_k_then_v():
    stored = tensors(qkv=(3 * SIZES.vision_heads * 4, 5))
    (spec,) = RegroupQKV("qkv").outputs(Stored("qkv", (24, 5)), SIZES)
    per_head = stored["qkv"].view(SIZES.vision_heads, 3, 4, 5)  # Megatron: [q_h | k_h | v_h] per head
    assert torch.equal(built(spec, stored), per_head.transpose(0, 1).reshape(-1, 5))


def test_concatenate_is_torch_cat_in_order():
    stored = tensors(a=(2, 3), b=(4, 3), c=(1, 3))
    spec = Concatenate("fused").of([Stored(k, tuple(stored[k].shape)) for k in ("b", "a", "c")])
    assert torch.equal(built(spec, stored), torch.cat([stored["b"], stored["a"], stored["c"]]))


def test_concatenate_parts_is_torch_cat_in_the_fused_order_whatever_order_the_parts_come_in():
    stored = tensors(**{"w.x": (4, 1, 3), "w.C": (2, 1, 3), "w.B": (2, 1, 3), "wide.B": (2, 1, 5)})
    parts = ConcatenateParts("conv1d.weight", ("x", "B", "C"))
    found = {part: Stored(f"w.{part}", tuple(stored[f"w.{part}"].shape)) for part in ("C", "x", "B")}
    spec = parts.of(found, SIZES)
    assert torch.equal(built(spec, stored), torch.cat([stored["w.x"], stored["w.B"], stored["w.C"]]))
    with pytest.raises(
        MergeError, match=r"^metadata.json: conv1d.weight: the checkpoint holds the parts B, x, not x, B, C$"
    ):
        parts.of({part: found[part] for part in ("x", "B")}, SIZES)
    with pytest.raises(MergeError, match=r"^metadata.json: conv1d.weight: its parts' shapes differ past the rows"):
        parts.of({**found, "B": Stored("wide.B", (2, 1, 5))}, SIZES)


def test_concatenate_parts_per_key_head_takes_every_parts_block_of_one_key_head_then_the_next():
    # Gated DeltaNet's in_proj saved as parts (megatron-core): Qwen3-Next's in_proj_qkvz is [q_h | k_h | v_h | z_h]
    # for each key head h, as the bridge's split_gdn_linear_weights cuts each part by key head and concatenates.
    names = ("query", "key", "value", "z")
    stored = tensors(query=(4, 3), key=(4, 3), value=(8, 3), z=(8, 3))
    found = {name: Stored(name, tuple(stored[name].shape)) for name in names}
    qkvz = ConcatenateParts("in_proj_qkvz", names, per_key_head=True)
    by_head = [stored[name].view(2, -1, 3) for name in names]
    got = built(qkvz.of(found, replace(SIZES, linear_key_heads=2)), stored)
    assert torch.equal(got, torch.cat(by_head, dim=1).reshape(-1, 3))
    with pytest.raises(MergeError, match=r"^metadata.json: query: 4 rows do not split into 3 key heads$"):
        qkvz.of(found, replace(SIZES, linear_key_heads=3))
    with pytest.raises(MergeError, match=r"^config.json: in_proj_qkvz: linear_num_key_heads is missing$"):
        qkvz.of(found, SIZES)


def test_add_one_is_the_stored_tensor_plus_one_in_its_own_dtype():
    # Megatron-Bridge's RMSNorm2ZeroCenteredRMSNormMapping: ``value.data += 1`` on the exported tensor.
    (spec,) = AddOne("norm.weight").outputs(Stored("w", (2, 6), (1,)), SIZES)
    assert (spec.add_one, spec.pieces[0].index, spec.pieces[0].rows) == (True, (1,), (0, 6))
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(6, generator=torch.Generator().manual_seed(0)).to(dtype) * 0.3
        expected = weight.clone()
        expected.data += 1
        (got,) = AddedOne(Computed(lambda weight=weight: weight)).pieces()
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # bit for bit


def test_per_expert_is_one_tensor_per_leading_index():
    stored = tensors(w1=(3, 4, 2))
    got = by_name(PerExpert("experts.{}.gate_proj.weight").outputs(Stored("w1", (3, 4, 2)), SIZES), stored)
    assert list(got) == [f"experts.{e}.gate_proj.weight" for e in range(3)]
    assert all(torch.equal(got[f"experts.{e}.gate_proj.weight"], stored["w1"][e]) for e in range(3))


def test_grouped_experts_and_rope_hand_the_rearranging_to_the_streamed_readers():
    (experts,) = GroupedExperts("down_proj").outputs(Stored("w2", (3, 4, 2)), SIZES)
    assert (experts.experts, experts.transpose, experts.interleave_halves) == (3, True, False)
    assert [p.index for p in experts.pieces] == [(0,), (1,), (2,)]
    (k,) = PermuteForRope("k_proj.weight", kv=True).outputs(Stored("wk", (12, 4)), SIZES)
    assert (k.rotary_heads, k.pieces[0].rows) == (SIZES.kv_heads, (0, 12))
    with pytest.raises(MergeError, match=r"^metadata.json: wq: 10 rows do not split into 4 rotary heads$"):
        PermuteForRope("q_proj.weight").outputs(Stored("wq", (10, 4)), SIZES)


def test_transpose_streams_one_matrix_as_a_single_expert_under_its_transposed_shape():
    (spec,) = Transpose("proj").outputs(Stored("w", (2, 6, 4), (1,)), SIZES)
    assert (spec.experts, spec.transpose, spec.shape, spec.pieces[0].index) == (1, True, (4, 6), (1,))
    with pytest.raises(MergeError, match=r"^metadata.json: b: shape \(6,\) is not a matrix to transpose$"):
        Transpose("bias").outputs(Stored("b", (6,)), SIZES)


def test_named_fills_every_hf_name_and_nothing_else():
    assert named(Chunk("{moe}.gate", "{moe}.up"), lambda n: "layers.0." + n.format(moe="mlp")) == Chunk(
        "layers.0.mlp.gate", "layers.0.mlp.up"
    )
    assert named(PermuteForRope("k", kv=True), "x.".__add__) == PermuteForRope("x.k", kv=True)
