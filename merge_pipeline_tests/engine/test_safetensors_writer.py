"""The streaming writer writes standard safetensors bytes and HF's shard split."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file

from merge_pipeline.engine.outputs import _split_shards
from merge_pipeline.engine.safetensors_writer import OutputTensor, write_safetensors
from merge_pipeline.plan import Computed, PlannedTensor
from merge_pipeline_tests.helpers import same_bits


def planned(name: str, tensor: torch.Tensor) -> PlannedTensor:
    return PlannedTensor(name, tuple(tensor.shape), tensor.dtype, Computed(lambda: tensor))


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "c.scalar": torch.tensor(2.5),
        "d.ids": torch.arange(6, dtype=torch.int64).view(2, 3),
        "e.empty": torch.empty(0, 4),
    }


def test_round_trip_and_header_rules(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    size = write_safetensors(path, [OutputTensor(planned(n, t), t.dtype) for n, t in tensors.items()])
    raw = path.read_bytes()
    assert size == len(raw)
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0, "data must start 8-byte aligned"
    header = json.loads(raw[8 : 8 + header_len])
    assert header.pop("__metadata__") == {"format": "pt"}
    offsets = [header[n]["data_offsets"] for n in tensors]
    assert offsets[0][0] == 0 and all(prev[1] == nxt[0] for prev, nxt in zip(offsets, offsets[1:])), (
        "data in header order, no gaps"
    )
    assert offsets[-1][1] == len(raw) - 8 - header_len
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name


def test_cast_on_write(tmp_path, tensors):
    path = tmp_path / "model.safetensors"
    t = tensors["a.weight"]
    write_safetensors(path, [OutputTensor(planned("a", t), torch.bfloat16)])
    assert same_bits(load_file(path)["a"], t.to(torch.bfloat16))


def test_source_giving_wrong_byte_count_fails(tmp_path):
    lying = PlannedTensor("x", (4,), torch.float32, Computed(lambda: torch.zeros(3)))
    with pytest.raises(RuntimeError, match="expected 16"):
        write_safetensors(tmp_path / "x.safetensors", [OutputTensor(lying, torch.float32)])


def test_shard_split_matches_huggingface_hub(tensors):
    tensors = {n: t for n, t in tensors.items() if t.numel()}
    expected = split_torch_state_dict_into_shards(tensors, max_shard_size=60)
    ours = _split_shards([OutputTensor(planned(n, t), t.dtype) for n, t in tensors.items()], 60)
    assert {s.filename: [t.planned.name for t in s.tensors] for s in ours} == expected.filename_to_tensors
