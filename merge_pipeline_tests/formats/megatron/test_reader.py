"""The Megatron reader plans, from metadata alone, exactly the weights each checkpoint was written from."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from merge_pipeline.hf.architecture import check_plan_against_architecture, expected_tensors
from merge_pipeline.plan import StoredBytes
from merge_pipeline_samples.megatron import VARIANTS
from merge_pipeline_tests.helpers import megatron_plan, same_bits


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_plan_matches_reference_bit_for_bit(megatron_samples, name):
    sample = megatron_samples[name]
    reference = load_file(sample.reference_dir / "model.safetensors")
    with megatron_plan(sample.role_dir) as p:
        assert p.is_value_model == sample.variant.value_model
        assert sorted(t.name for t in p.tensors) == sorted(reference)
        for t in p.tensors:
            assert same_bits(t.load(), reference[t.name]), t.name
        hf_dir = sample.role_dir / "huggingface"
        expected = expected_tensors(hf_dir, value_model=p.is_value_model, trust_remote_code=False)
        check_plan_against_architecture(p.tensors, expected, hf_dir / "config.json")


@pytest.mark.parametrize(
    ("name", "facts"),
    [
        ("qwen2_tp2", {"tp": 2, "pp": 1, "layer_keys": "stacked", "num_layers": 4}),
        ("llama_tied_pp2", {"tp": 1, "pp": 2, "tie_word_embeddings": True, "dtypes": ["bfloat16", "float32"]}),
        # two chunks per rank, saved as model0 / model1: their layers land in one stacked tensor
        ("qwen2_pp2_vpp2", {"pp": 2, "vpp": 2, "layer_keys": "stacked", "num_layers": 4}),
        ("qwen2_moe_ep2", {"ep": 2, "layer_keys": "stacked"}),
        ("qwen3_moe_tp2_per_layer", {"tp": 2, "layer_keys": "per-layer"}),
        ("deepseek_v3_mla", {"layer_keys": "per-layer", "num_layers": 2}),
        ("qwen2_hf_weights", {"weights": "huggingface safetensors", "files": 2}),
    ],
)
def test_layout_reports_how_the_checkpoint_was_saved(megatron_samples, name, facts):
    with megatron_plan(megatron_samples[name].role_dir) as p:
        assert {k: p.layout.get(k) for k in facts} == facts
        assert p.backend == "megatron"


def test_virtual_pipeline_fixture_interleaves_layers_over_the_ranks(megatron_samples):
    """The VPP fixture is what it claims: at PP=2 x VPP=2 megatron-core gave rank 0 layers 0 and 2 (its
    chunks model0 and model1) and rank 1 layers 1 and 3, each saved by its rank (``__<rank>_*.distcp``)."""
    metadata = FileSystemReader(megatron_samples["qwen2_pp2_vpp2"].role_dir / "dist_ckpt").read_metadata()
    key = "decoder.layers.self_attention.linear_proj.weight"
    saved_by = {i.offset[0]: s.relative_path.split("_")[2] for i, s in metadata.storage_data.items() if i.fqn == key}
    assert saved_by == {0: "0", 1: "1", 2: "0", 3: "1"}


def test_tensors_whose_rows_are_whole_are_byte_copies(megatron_samples):
    """Column-parallel splits (QKV per group, fc1, embeddings) need no per-element work; only a
    row-parallel weight stored in column chunks (o_proj, down_proj under TP) is assembled."""
    with megatron_plan(megatron_samples["qwen2_tp2"].role_dir) as p:
        computed = {t.name for t in p.tensors if t.source.byte_runs() is None}
        assert computed == {
            f"model.layers.{i}.{n}" for i in range(4) for n in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
        }
        qkv = next(t for t in p.tensors if t.name == "model.layers.1.self_attn.q_proj.weight")
        assert isinstance(qkv.source, StoredBytes) and len(qkv.source.runs) == 2  # one run per KV group


def test_row_parallel_weights_stream_in_blocks_of_whole_rows(megatron_samples):
    """A row-parallel weight is never built whole: each piece is a block of rows, filled from every
    TP rank's columns of those rows, and the blocks together are the weight bit for bit."""
    sample = megatron_samples["qwen2_tp2"]
    reference = load_file(sample.reference_dir / "model.safetensors")
    with megatron_plan(sample.role_dir) as p:
        down = next(t for t in p.tensors if t.name == "model.layers.3.mlp.down_proj.weight")
        row_bytes = down.nbytes() // down.shape[0]
        down.source.block_bytes = 3 * row_bytes  # three rows per block: the last block is partial
        pieces = [piece.clone() for piece in down.source.pieces()]
        assert len(pieces) == -(-down.shape[0] // 3)
        assert max(piece.numel() for piece in pieces) * down.dtype.itemsize <= 3 * row_bytes
        assert same_bits(torch.cat(pieces).view(down.shape), reference[down.name])


def test_one_layer_at_a_time(megatron_samples):
    """A layer's tensor reads only that layer's bytes, never the whole stacked tensor."""
    with megatron_plan(megatron_samples["qwen2_tp2"].role_dir) as p:
        o_proj = next(t for t in p.tensors if t.name == "model.layers.2.self_attn.o_proj.weight")
        reads = []
        for f in p.files:
            original = f.read_into
            f.read_into = lambda buffer, offset, original=original: (
                reads.append(len(buffer)),
                original(buffer, offset),
            )[1]
        o_proj.load()
        assert sum(reads) == o_proj.nbytes()


def test_value_model_flag_must_agree_with_the_head(megatron_samples):
    with megatron_plan(megatron_samples["qwen2_value"].role_dir, is_value_model=True) as p:
        assert p.is_value_model
        bias = next(t for t in p.tensors if t.name == "score.bias")
        assert bias.load().abs().sum() == 0  # verl's head has no bias: a zero bias is the same function


def test_tie_flag_overrides_config(megatron_samples):
    with megatron_plan(megatron_samples["qwen2_tp2"].role_dir, tie_word_embedding=True) as p:
        assert p.layout["tie_word_embeddings"] is True
        assert "lm_head.weight" in {t.name for t in p.tensors}  # stored, so kept; the engine decides
