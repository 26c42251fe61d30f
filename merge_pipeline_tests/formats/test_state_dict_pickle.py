"""The rank-file pickle interpreter (``formats/state_dict_pickle.py``) on real torch.save archives.

A state dict torch.save wrote reads as torch.load reads it (views, offsets, dtypes, the bytes each
tensor's range holds); a pickle asking for anything else -- an allocation, a call, a class changed, a
hash or repr that grows without bound -- is refused in one bounded line, before it runs.
"""

from __future__ import annotations

import io
import struct
import time
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.torch_files import load_meta_archive, stored_tensor

WEIGHTS = torch.arange(24, dtype=torch.float32).reshape(4, 6)


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def read(data: bytes):
    return load_meta_archive(io.BytesIO(data), Path("crafted.pt"))


def with_pickle(data: bytes, change) -> bytes:
    """The archive ``data`` with its pickle replaced by ``change(pickle)``, re-packed by zipfile (stored)."""
    with zipfile.ZipFile(io.BytesIO(data)) as source:
        members = [(i.filename, source.read(i)) for i in source.infolist()]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as target:
        for name, member in members:
            target.writestr(zipfile.ZipInfo(name), change(member) if name.endswith("/data.pkl") else member)
    return out.getvalue()


def linear_state():
    torch.manual_seed(0)
    return torch.nn.Linear(6, 4).state_dict()  # an OrderedDict with _metadata


STATES = {
    "module state dict": linear_state,
    "views of one storage": lambda: {"w": WEIGHTS, "t": WEIGHTS.t(), "row": WEIGHTS[2], "cols": WEIGHTS[:, 1:4]},
    "dtypes": lambda: {"bf16": WEIGHTS.bfloat16(), "int": torch.arange(5), "bool": WEIGHTS > 3, "empty": WEIGHTS[:0]},
    "parameter": lambda: {"p": torch.nn.Parameter(WEIGHTS.clone())},
    "tensor with an attribute": lambda: {"ds": _with_attribute(WEIGHTS.clone())},
}


def _with_attribute(tensor):
    tensor.ds_id = "0_18"  # DeepSpeed's optimizer state pickles tensors so
    return tensor


@pytest.mark.parametrize("make", STATES.values(), ids=list(STATES))
def test_a_state_dict_reads_as_torch_load_reads_it(make):
    data = saved(make())
    expected = torch.load(io.BytesIO(data), weights_only=True)

    found = read(data)

    assert type(found) is type(expected) and list(found) == list(expected)
    assert getattr(found, "_metadata", None) == getattr(expected, "_metadata", None)
    for name, tensor in expected.items():
        meta = found[name]
        assert type(meta) is type(tensor) and meta.is_meta, name
        assert (meta.shape, meta.stride(), meta.storage_offset(), meta.dtype) == (
            tensor.shape,
            tensor.stride(),
            tensor.storage_offset(),
            tensor.dtype,
        ), name
        assert meta.requires_grad == tensor.requires_grad and vars(meta) == vars(tensor), name
        if meta.is_contiguous():  # the file range the merge copies holds torch.load's bytes
            run = stored_tensor(Path("x"), name, meta, len(data)).byte_run(None)
            stored = data[run.offset : run.offset + run.length]
            assert stored == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name


def ops(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def global_(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def unicode(text: str) -> bytes:
    return b"X" + struct.pack("<I", len(text.encode())) + text.encode()


def nested_key(depth: int) -> bytes:
    """A tuple of two references to a tuple of two ... ``depth`` deep: hashing it takes 2**depth steps."""
    body = unicode("x") + b"\x85r" + struct.pack("<I", 1000)
    for level in range(depth):
        body += b"j" + struct.pack("<I", 1000 + level) + b"\x86r" + struct.pack("<I", 1001 + level)
    return body


# Each pickle replaces a real archive's (whose storage "0" holds 24 float32); what our reader says.
CRAFTED = {
    "bytearray(3 * 10**9)": (
        ops(global_("builtins", "bytearray") + b"\x8a\x05\x00\x5e\xd0\xb2\x00\x85R"),
        "the file names the global builtins.bytearray, which is not allowed",
    ),
    "torch.Size((10**9,)) of torch.Tensor": (
        ops(global_("torch", "Tensor") + global_("torch", "Size") + b"J\x00\xca\x9a\x3b\x85\x85R\x85R"),
        "REDUCE at byte 37 calls the class torch.Tensor, which a state dict is never rebuilt with",
    ),
    "a placement class called": (
        ops(global_("torch.distributed.tensor.placement_types", "Shard") + b"K\x00\x85R"),
        "calls the class torch.distributed.tensor.placement_types.Shard",
    ),
    "NEWOBJ of a function": (
        ops(global_("torch._utils", "_rebuild_tensor_v2") + b")\x81"),
        "NEWOBJ at byte 36 makes the function torch._utils._rebuild_tensor_v2",
    ),
    "BUILD on a class": (
        ops(global_("torch.distributed.device_mesh", "DeviceMesh") + b"}" + unicode("_rank") + b"K\x07sb"),
        "BUILD at byte 58 on torch.distributed.device_mesh.DeviceMesh: only the objects of a state dict's classes",
    ),
    "BUILD setting a mesh's attribute to a nested tuple": (
        ops(
            global_("torch.distributed.device_mesh", "DeviceMesh")
            + b")\x81}"
            + unicode("_coordinate_on_dim")
            + b"K\x00\x85\x85sb"
        ),
        "DeviceMesh._coordinate_on_dim cannot be tuple of 1",
    ),
    "a dict key that hashes in 2**60 steps": (
        ops(b"}" + nested_key(60) + b"Ns"),
        "a dict key of type tuple",
    ),
    "two objects left on the stack": (ops(b"}}"), "the pickle leaves 2 objects, not one"),
    "protocol 4's SHORT_BINUNICODE": (ops(b"\x8c\x01x"), "unsupported pickle opcode 0x8c at byte 2"),
    "truncated string": (ops(b"X\xff\x00\x00\x00abc")[:-1], "truncated pickle: 255 bytes at byte 7"),
    "a view past its storage": (
        ops(
            global_("torch._utils", "_rebuild_tensor_v2")
            + b"(("
            + unicode("storage")
            + global_("torch", "FloatStorage")
            + unicode("0")
            + unicode("cpu")
            + b"K\x18tQK\x10K\x04K\x03\x86K\x03K\x01\x86\x89"
            + global_("collections", "OrderedDict")
            + b")RtR"
        ),
        "tensor view (shape (4, 3), stride (3, 1), offset 16) reaches element 27 but its storage data/0 holds 24",
    ),
    "a negated view (metadata)": (
        ops(
            global_("torch._utils", "_rebuild_tensor_v2")
            + b"(("
            + unicode("storage")
            + global_("torch", "FloatStorage")
            + unicode("0")
            + unicode("cpu")
            + b"K\x18tQK\x00K\x18\x85K\x01\x85\x89"
            + global_("collections", "OrderedDict")
            + b")R}"
            + unicode("neg")
            + b"\x88stR"
        ),
        "_rebuild_tensor_v2 called with (TypedStorage, int, tuple of 1, tuple of 1, bool, OrderedDict, dict of 1)",
    ),
    "a storage key that is a deep tuple": (
        ops(
            b"(" + unicode("storage") + global_("torch", "FloatStorage") + nested_key(40) + unicode("cpu") + b"K\x18tQ"
        ),
        "malformed storage reference (str, StorageType, tuple, str, int)",
    ),
}


@pytest.mark.parametrize("pickled, problem", CRAFTED.values(), ids=list(CRAFTED))
def test_a_pickle_asking_for_more_than_a_state_dict_is_refused_at_once(pickled, problem):
    data = with_pickle(saved({"w": WEIGHTS}), lambda _: pickled)
    started = time.monotonic()

    with pytest.raises(MergeError) as refused:
        read(data)

    assert problem in refused.value.problem, refused.value.problem
    assert len(str(refused.value)) < 400 and time.monotonic() - started < 1


def test_an_ordered_dict_takes_only_its_metadata():
    state = OrderedDict(w=WEIGHTS)
    state._metadata = {"": {"version": 1}}
    data = with_pickle(saved(state), lambda p: p.replace(b"_metadata", b"_metadate"))

    with pytest.raises(MergeError, match="BUILD at byte .*: OrderedDict._metadate cannot be dict of 1"):
        read(data)
