"""Only outputs the safetensors library itself would open: no name read twice from a header, no tensor
named like the header's reserved ``__metadata__`` entry, no header over the library's 100 MB limit.
Each is one line and exit 1 with no output; before, each gave exit 0 and an ambiguous or unloadable folder.
"""

from __future__ import annotations

import json
import shutil
import struct

import torch

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import merge_error

PLAIN = FsdpSpec(fsdp_version=1, world_size=1)  # plain tensors in one rank file: any key can be written


def merge_refused(capsys, local_dir, target) -> str:
    line = merge_error(capsys, local_dir, target)
    assert not any(target.parent.glob(f".{target.name}.*"))
    return line


def test_a_header_naming_a_tensor_twice_is_refused(capsys, tmp_path, fsdp_checkpoint):
    """The consolidated HF folder (NeMo-Automodel's model/) whose header lists a name twice: we took the last."""
    model_dir = tmp_path / "role" / "model"
    shutil.copytree(fsdp_checkpoint(PLAIN).reference_dir, model_dir)
    weights = model_dir / "model.safetensors"
    raw = weights.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    first, second = (n for n in header if n.endswith("q_proj.weight"))  # two tensors of one shape
    # The second's bytes listed again under the first's name: json.loads keeps the last entry of a name.
    again = header.pop(second)
    text = json.dumps(header)[:-1] + f", {json.dumps(first)}: {json.dumps(again)}}}"
    text += " " * (-len(text) % 8)
    weights.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + length :])

    line = merge_refused(capsys, tmp_path / "role", tmp_path / "out")

    assert line == f"error: {weights}: header names the tensor {first!r} twice"


def test_a_tensor_named_like_the_reserved_metadata_entry_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(PLAIN))
    rank_file = sample.role_dir / "model_world_size_1_rank_0.pt"
    state = torch.load(rank_file, weights_only=True)
    state["__metadata__"] = state.pop("model.norm.weight")
    torch.save(state, rank_file)

    line = merge_refused(capsys, sample.role_dir, tmp_path / "out")

    assert line == f"error: {sample.role_dir}: a tensor is named '__metadata__', which safetensors reserves: refused"


def test_a_header_over_the_library_limit_is_refused_with_the_way_out(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    """5,000 tensors with 21,000-character names: a 105 MB header, which safetensors would not open."""
    sample = fresh_copy(fsdp_checkpoint(PLAIN))
    rank_file = sample.role_dir / "model_world_size_1_rank_0.pt"
    one = torch.zeros(1)
    torch.save({f"model.{i:05d}.{'x' * 21_000}.weight": one.clone() for i in range(5_000)}, rank_file)

    line = merge_refused(capsys, sample.role_dir, tmp_path / "out")

    assert line.startswith(f"error: {sample.role_dir}: model.safetensors: its header (tensor names) would be 105,")
    assert line.endswith("bytes, over the 100,000,000 bytes safetensors reads: pass a smaller --max-shard-size")
