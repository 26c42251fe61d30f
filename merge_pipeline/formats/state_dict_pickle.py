"""A torch.save pickle read by an interpreter that can build a state dict and nothing else.

torch's weights-only unpickler refuses every global outside its allow-list, but calls whatever of
that list a pickle asks for, with any arguments: ``bytearray(3 * 10**9)`` and ``torch.Tensor(...)``
allocate gigabytes from a few bytes, ``DeviceMesh(...)`` starts ``torch.distributed`` (a listening
socket when ``MASTER_*`` is set), the rebuild functions take any sizes. Once 3 of 1024 rank files
are unpickled its speed no longer matters (docs/BENCHMARKS.md), its breadth does; so the
pickle is read here, by the opcodes torch's unpickler reads (any other one is refused, as there),
where each opcode can do only this:

- GLOBAL names one of the entries below (any other name is refused) and pushes a stand-in for it,
  never the class or function itself: a class object is never on the stack, so no BUILD reaches one.
- REDUCE calls only what a state dict is rebuilt with, each with its argument types, counts and
  sizes checked first: ``OrderedDict()``, ``torch.Size``, ``torch.device``, the strided layout,
  ``_rebuild_tensor_v2`` (a meta view that must lie inside its storage: no negative stride, no
  offset or extent past the storage's bytes), ``_rebuild_parameter``, and a DTensor's
  ``_rebuild_from_type_v2(_rebuild_wrapper_subclass, DTensor, ...)``.
- NEWOBJ makes only the DTensor family's plain-data classes (``DTensorSpec``, ``DeviceMesh``, its
  layouts, the placements, ``TensorMeta``, ``ShardOrderEntry``) and a reader's stand-ins, without
  running their ``__init__``: a ``DeviceMesh`` is its attributes, never a process group.
- BUILD sets attributes only on such an instance (or an ``OrderedDict``'s ``_metadata``), each
  checked against its class's schema, so that nothing built can grow when later used
  (a tuple nested a thousand times and shared, say).
- SETITEM keys are plain scalars (never a tuple to hash), APPEND only extends a list.

A pickle that leaves more than its one object on the stack is refused. Every refusal is one line
(``PickleRefused``) naming types, lengths and byte positions, never a repr of what the pickle built.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pickle import decode_long

import torch
from torch.distributed._mesh_layout import _FlatLayout, _MeshLayout
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from merge_pipeline.errors import MergeError

_MAX_DIMS = 64  # a tensor's (or a mesh's) dimensions; torch's own limit is lower
_MAX_RANKS = 1 << 24  # entries of a mesh's rank map
_MAX_STATE = 64  # attributes BUILD sets on one object
_MAX_NAME = 256  # characters of a global's name, a device, a mesh dimension's name
_PLAIN = (type(None), bool, int, float, str)  # values that cannot hold anything else
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
_U16 = struct.Struct("<H").unpack_from
_F64 = struct.Struct(">d").unpack_from


class PickleRefused(Exception):
    """What the pickle asked for that a state dict never needs, in one bounded line."""


@dataclass(frozen=True, eq=False)
class _Function:
    """What GLOBAL pushes for a callable the pickle may REDUCE: ``call`` checks the arguments first."""

    name: str
    call: Callable[[tuple], object]


@dataclass(frozen=True, eq=False)
class _Class:
    """What GLOBAL pushes for a class the pickle may make with NEWOBJ (``new`` checks the arguments)."""

    name: str
    cls: type
    new: Callable[[tuple], object]


def _refuse(problem: str) -> None:
    raise PickleRefused(problem)


def _dims(value: object, limit: int = _MAX_DIMS) -> bool:
    """A tuple of at most ``limit`` ints >= 0 (a size, a stride, a coordinate)."""
    return type(value) is tuple and len(value) <= limit and all(type(v) is int and v >= 0 for v in value)


def _short_str(value: object) -> bool:
    return type(value) is str and len(value) <= _MAX_NAME


def _nothing_but(cls: type) -> Callable[[object], bool]:
    return lambda value: type(value) is cls


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda value: value is None or check(value)


def _tuple_of(check: Callable[[object], bool], limit: int = _MAX_DIMS) -> Callable[[object], bool]:
    return lambda value: type(value) is tuple and len(value) <= limit and all(check(v) for v in value)


def _meta_tensor(value: object) -> bool:
    return type(value) is torch.Tensor and value.is_meta


_PLACEMENTS = (Shard, _StridedShard, Replicate, Partial)

# The attributes BUILD may set on each class and what each must hold (torch 2.13's pickles of these
# classes). An attribute not listed may hold a plain scalar only: another torch's extra field is read,
# nothing that could nest is.
_SCHEMAS: dict[type, dict[str, Callable[[object], bool]]] = {
    DTensorSpec: {
        "mesh": _nothing_but(DeviceMesh),
        "placements": _tuple_of(lambda p: type(p) in _PLACEMENTS),
        "tensor_meta": _optional(_nothing_but(TensorMeta)),
        "shard_order": _optional(_tuple_of(_nothing_but(ShardOrderEntry))),
        "use_strided_shard_as_shard_order": _optional(_nothing_but(bool)),
        "_hash": _optional(_nothing_but(int)),
    },
    DeviceMesh: {
        "_device_type": _short_str,
        "_layout": _nothing_but(_MeshLayout),
        "_rank_map": _meta_tensor,
        "_mesh_dim_names": _optional(_tuple_of(_short_str)),
        "_root_mesh": _optional(_nothing_but(DeviceMesh)),
        "_flatten_rank_map": lambda value: _dims(value, _MAX_RANKS),
        "_thread_id": _optional(_nothing_but(int)),
        "_flatten_mapping": lambda value: (
            type(value) is dict
            and len(value) <= _MAX_DIMS
            and all(_short_str(k) and type(v) is DeviceMesh for k, v in value.items())
        ),
        "_dim_group_names": lambda value: (
            type(value) is list and len(value) <= _MAX_DIMS and all(map(_short_str, value))
        ),
        "_rank": _nothing_but(int),
        "_coordinate_on_dim": _optional(_dims),
        "_hash": _optional(_nothing_but(int)),
    },
    Shard: {"dim": _nothing_but(int)},
    _StridedShard: {"dim": _nothing_but(int), "split_factor": _nothing_but(int)},
    Replicate: {},
    Partial: {"reduce_op": _short_str},
    _MeshLayout: {"axes": _tuple_of(_nothing_but(_FlatLayout))},
    _FlatLayout: {"shape": _dims, "stride": _dims},
}


class StateDictUnpickler:
    """Reads one pickle (``load``). ``persistent_load(pid)`` returns the storage a tuple pid names (it
    checks the pid); ``stand_ins``: a reader's inert classes by global name, made by NEWOBJ (then BUILD
    sets plain attributes) or REDUCE with scalar arguments, for its trainer's plain-data classes."""

    def __init__(
        self,
        pickled: bytes,
        persistent_load: Callable[[tuple], torch.storage.TypedStorage],
        stand_ins: Mapping[str, type] | None = None,
    ):
        self.pickled = pickled
        self.persistent_load = persistent_load
        self.storages: dict[int, torch.storage.TypedStorage] = {}  # by id: the storages the pids named
        self.globals = {**_globals(self), **{name: _stand_in(name, cls) for name, cls in (stand_ins or {}).items()}}
        self.schemas = {**_SCHEMAS, **{cls: None for cls in (stand_ins or {}).values()}}
        self.checked: dict[int, object] = {}  # id -> container already found to fit its schema (kept alive)

    def load(self) -> object:
        data, pos = self.pickled, 0
        stack: list = []
        metastack: list[list] = []
        memo: dict[int, object] = {}
        try:
            while True:
                op = data[pos]
                pos += 1
                # Ordered by how often torch.save's pickles use each opcode.
                if op == 0x72:  # LONG_BINPUT
                    memo[_U32(data, pos)[0]] = stack[-1]
                    pos += 4
                elif op == 0x68:  # BINGET
                    stack.append(memo[data[pos]])
                    pos += 1
                elif op == 0x4B:  # BININT1
                    stack.append(data[pos])
                    pos += 1
                elif op == 0x71:  # BINPUT
                    memo[data[pos]] = stack[-1]
                    pos += 1
                elif op == 0x28:  # MARK
                    metastack.append(stack)
                    stack = []
                elif op == 0x58:  # BINUNICODE
                    length = _U32(data, pos)[0]
                    pos += 4
                    _whole(data, pos, length)
                    stack.append(str(data[pos : pos + length], "utf-8", "surrogatepass"))
                    pos += length
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    function = stack[-1]
                    if type(function) is not _Function:
                        what = (
                            f"the class {function.name}" if type(function) is _Class else f"a value ({_kind(function)})"
                        )
                        _refuse(f"REDUCE at byte {pos - 1} calls {what}, which a state dict is never rebuilt with")
                    if type(args) is not tuple:
                        _refuse(f"REDUCE at byte {pos - 1}: {function.name} given {_kind(args)} as its arguments")
                    stack[-1] = function.call(args)
                elif op == 0x85:  # TUPLE1
                    stack[-1] = (stack[-1],)
                elif op == 0x74:  # TUPLE
                    items, stack = stack, metastack.pop()
                    stack.append(tuple(items))
                elif op == 0x86:  # TUPLE2
                    stack[-2:] = [(stack[-2], stack[-1])]
                elif op == 0x7D:  # EMPTY_DICT
                    stack.append({})
                elif op == 0x89:  # NEWFALSE
                    stack.append(False)
                elif op == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                elif op == 0x73:  # SETITEM
                    value = stack.pop()
                    key = stack.pop()
                    self._set_items(stack[-1], (key, value), pos - 1)
                elif op == 0x75:  # SETITEMS
                    items, stack = stack, metastack.pop()
                    self._set_items(stack[-1], items, pos - 1)
                elif op == 0x6A:  # LONG_BINGET
                    stack.append(memo[_U32(data, pos)[0]])
                    pos += 4
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    cls = stack.pop()
                    if type(cls) is not _Class:
                        what = f"the function {cls.name}" if type(cls) is _Function else f"a value ({_kind(cls)})"
                        _refuse(f"NEWOBJ at byte {pos - 1} makes {what}, which is not a class a state dict holds")
                    if type(args) is not tuple:
                        _refuse(f"NEWOBJ at byte {pos - 1}: {cls.name} given {_kind(args)} as its arguments")
                    stack.append(cls.new(args))
                elif op == 0x4E:  # NONE
                    stack.append(None)
                elif op == 0x51:  # BINPERSID
                    pid = stack.pop()
                    if type(pid) is not tuple:
                        _refuse(f"persistent id at byte {pos - 1} is {_kind(pid)}, not a storage reference")
                    storage = self.persistent_load(pid)
                    self.storages[id(storage)] = storage
                    stack.append(storage)
                elif op == 0x4D:  # BININT2
                    stack.append(_U16(data, pos)[0])
                    pos += 2
                elif op == 0x63:  # GLOBAL
                    end = data.index(b"\n", pos, pos + 2 * _MAX_NAME)
                    end = data.index(b"\n", end + 1, end + 1 + 2 * _MAX_NAME)
                    module, name = data[pos:end].decode("utf-8").split("\n")
                    pos = end + 1
                    found = self.globals.get(f"{module}.{name}")
                    if found is None:
                        _refuse(f"the file names the global {module}.{name}, which is not allowed")
                    stack.append(found)
                elif op == 0x62:  # BUILD
                    state = stack.pop()
                    self._build(stack[-1], state, pos - 1)
                elif op == 0x87:  # TUPLE3
                    stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
                elif op == 0x8A:  # LONG1
                    length = data[pos]
                    _whole(data, pos + 1, length)
                    stack.append(decode_long(data[pos + 1 : pos + 1 + length]))
                    pos += 1 + length
                elif op == 0x4A:  # BININT
                    stack.append(_I32(data, pos)[0])
                    pos += 4
                elif op == 0x88:  # NEWTRUE
                    stack.append(True)
                elif op == 0x5D:  # EMPTY_LIST
                    stack.append([])
                elif op == 0x61:  # APPEND
                    item = stack.pop()
                    _list(stack[-1], pos - 1).append(item)
                elif op == 0x65:  # APPENDS
                    items, stack = stack, metastack.pop()
                    _list(stack[-1], pos - 1).extend(items)
                elif op == 0x47:  # BINFLOAT
                    stack.append(_F64(data, pos)[0])
                    pos += 8
                elif op == 0x55:  # SHORT_BINSTRING
                    length = data[pos]
                    _whole(data, pos + 1, length)
                    stack.append(data[pos + 1 : pos + 1 + length].decode("utf-8"))
                    pos += 1 + length
                elif op == 0x8F:  # EMPTY_SET
                    stack.append(set())
                elif op == 0x80:  # PROTO
                    pos += 1
                elif op == 0x2E:  # STOP
                    if metastack or len(stack) != 1:
                        _refuse(f"the pickle leaves {len(stack) + sum(map(len, metastack))} objects, not one")
                    return stack[0]
                else:
                    _refuse(f"unsupported pickle opcode 0x{op:02x} at byte {pos - 1}")
        except (PickleRefused, MergeError):  # the latter from persistent_load, naming the file's records
            raise
        except Exception as exc:  # a malformed pickle: whatever failed, at a byte we can name
            raise PickleRefused(f"malformed pickle at byte {pos}: {type(exc).__name__}") from None

    def _set_items(self, target: object, items: list | tuple, at: int) -> None:
        if type(target) not in (dict, OrderedDict):
            _refuse(f"SETITEM at byte {at} into {_kind(target)}: only a dict takes items")
        if len(items) % 2:
            _refuse(f"SETITEMS at byte {at} with an odd number of keys and values")
        for i in range(0, len(items), 2):
            if type(items[i]) not in _PLAIN:
                _refuse(f"SETITEM at byte {at}: a dict key of type {type(items[i]).__name__}")
            target[items[i]] = items[i + 1]

    def _build(self, instance: object, state: object, at: int) -> None:
        """Sets checked attributes on an instance NEWOBJ made (or an OrderedDict's ``_metadata``)."""
        cls = type(instance)
        if cls is OrderedDict:
            schema = {"_metadata": lambda value: type(value) in (dict, OrderedDict)}
        elif cls in self.schemas:
            schema = self.schemas[cls]
        else:
            _refuse(f"BUILD at byte {at} on {_kind(instance)}: only the objects of a state dict's classes are built")
        if type(state) is not dict or len(state) > _MAX_STATE or not all(type(k) is str for k in state):
            _refuse(f"BUILD at byte {at} of a {cls.__name__} with {_kind(state)}, not a dict of attributes")
        if schema is not None:  # a reader's stand-in takes any attributes: its reader checks what it uses
            for key, value in state.items():
                check = schema.get(key)
                if not (self._fits(check, value) if check is not None else type(value) in _PLAIN):
                    _refuse(f"BUILD at byte {at}: {cls.__name__}.{key[:40]} cannot be {_kind(value)}")
        if cls in _PLACEMENTS:
            instance.__setstate__(state)  # their C++ fields
        else:
            # No class's own __setstate__: DeviceMesh's would look up process groups by the pickle's names.
            instance.__dict__.update(state)
            if cls is DeviceMesh:
                instance._pg_registry = {}

    def _fits(self, check: Callable[[object], bool], value: object) -> bool:
        """``check(value)``, once per container: one tuple BUILT into many objects is checked once."""
        if type(value) in _PLAIN:
            return check(value)
        if self.checked.get(id(value)) is value:
            return True
        if not check(value):
            return False
        self.checked[id(value)] = value
        return True


def _whole(data: bytes, start: int, length: int) -> None:
    if start + length > len(data):
        _refuse(f"truncated pickle: {length} bytes at byte {start}, past its end")


def _kind(value: object) -> str:
    """What ``value`` is, in a few words that never grow with its contents."""
    if type(value) in (_Function, _Class):
        return value.name
    if type(value) in (tuple, list, dict):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def _attributes(state: object) -> dict | None:
    """A tensor subclass's pickled state as one dict: a dict, or (``__dict__`` or None, slots or None)."""
    if type(state) is dict:
        return state
    if type(state) is tuple and len(state) == 2 and all(part is None or type(part) is dict for part in state):
        return {**(state[0] or {}), **(state[1] or {})}
    return None


def _list(target: object, at: int) -> list:
    if type(target) is not list:
        _refuse(f"APPEND at byte {at} to {_kind(target)}: only a list is appended to")
    return target


def _arguments(name: str, args: tuple, *checks: Callable[[object], bool], optional: int = 0) -> tuple:
    """``args`` when each passes its check (the last ``optional`` ones may be left out)."""
    if not len(checks) - optional <= len(args) <= len(checks) or not all(c(a) for c, a in zip(checks, args)):
        kinds = ", ".join(_kind(a) for a in args[: len(checks) + 1])
        _refuse(f"{name} called with ({kinds}), not the arguments torch.save writes")
    return args


def _stand_in(name: str, cls: type) -> _Class | _Function:
    """A reader's stand-in: NEWOBJ with no arguments, or a call with scalars (an enum's value)."""
    entry = _Class(
        name, cls, lambda args: cls.__new__(cls) if args == () else _refuse(f"NEWOBJ of {name} with arguments")
    )
    return (
        entry
        if not issubclass(cls, int)
        else _Function(name, lambda args: cls(*_arguments(name, args, _nothing_but(int))))
    )


def _globals(unpickler: StateDictUnpickler) -> dict[str, _Function | _Class | object]:
    """Every global a state dict's pickle may name: values (dtypes, storage types) pushed as they are,
    functions and classes as checked stand-ins."""
    from torch._weights_only_unpickler import _get_allowed_globals

    def rebuild_tensor(args: tuple) -> torch.Tensor:
        storage, offset, size, stride, requires_grad, hooks, *metadata = _arguments(
            "_rebuild_tensor_v2",
            args,
            lambda s: unpickler.storages.get(id(s)) is s,
            lambda o: type(o) is int and o >= 0,
            _dims,
            _dims,
            _nothing_but(bool),
            lambda h: type(h) is OrderedDict and not h,
            lambda m: m is None or (type(m) is dict and not any(m.values())),
            optional=1,
        )
        if len(size) != len(stride):
            _refuse(f"_rebuild_tensor_v2: size of {len(size)} dimensions with a stride of {len(stride)}")
        untyped = storage._untyped_storage
        item = storage.dtype.itemsize
        if all(size):  # torch's set_ on a storage read from the file: the view must lie inside it
            last = offset + sum((n - 1) * s for n, s in zip(size, stride))
            if (last + 1) * item > untyped._checkpoint_nbytes:
                _refuse(
                    f"tensor view (shape {size}, stride {stride}, offset {offset}) reaches element {last} but its storage data/{untyped._checkpoint_key} holds {untyped._checkpoint_nbytes // item}"
                )
        tensor = torch.empty((0,), dtype=storage.dtype, device="meta").set_(untyped, offset, size, stride)
        if requires_grad:
            tensor.requires_grad_()  # torch's own refusal for an integer tensor
        return tensor

    def rebuild_parameter(args: tuple) -> torch.nn.Parameter:
        data, requires_grad, _ = _arguments(
            "_rebuild_parameter", args, _meta_tensor, _nothing_but(bool), lambda h: type(h) is OrderedDict and not h
        )
        return torch.nn.Parameter(data, requires_grad)

    def rebuild_from_type(args: tuple) -> torch.Tensor:
        """A DTensor (``_rebuild_wrapper_subclass``, its local tensor and spec), or a plain tensor with a few
        plain attributes (DeepSpeed's ``ds_id``): the two a state dict's pickle rebuilds from a type."""
        rebuild, new_type, inner, state = _arguments(
            "_rebuild_from_type_v2",
            args,
            lambda f: f is wrapper_subclass or f is tensor_v2,
            lambda t: t is dtensor or t is plain_tensor,
            _nothing_but(tuple),
            lambda s: _attributes(s) is not None,
        )
        if (rebuild is tensor_v2) != (new_type is plain_tensor):
            _refuse(f"_rebuild_from_type_v2 makes a {new_type.name} with {rebuild.name}")
        state = _attributes(state)
        if rebuild is tensor_v2:
            tensor = rebuild_tensor(inner)
            for name, value in state.items():
                if type(value) not in _PLAIN or name.startswith("__") or hasattr(torch.Tensor, name):
                    _refuse(f"a tensor given the attribute {name[:40]} ({_kind(value)}): only new plain ones are kept")
                setattr(tensor, name, value)
            return tensor
        _, dtype, size, stride, offset, layout, device, requires_grad = _arguments(
            "_rebuild_wrapper_subclass",
            inner,
            lambda c: c is dtensor,
            _nothing_but(torch.dtype),
            _dims,
            _dims,
            lambda o: type(o) is int and o >= 0,
            lambda x: x is torch.strided,
            _nothing_but(torch.device),
            _nothing_but(bool),
        )
        if set(state) != {"_local_tensor", "_spec"} or not (
            _meta_tensor(state["_local_tensor"]) and type(state["_spec"]) is DTensorSpec
        ):
            _refuse("a DTensor's state must be its local meta tensor and its DTensorSpec, and nothing else")
        if len(size) != len(stride):
            _refuse(f"a DTensor of {len(size)} dimensions with a stride of {len(stride)}")
        tensor = torch._utils._rebuild_wrapper_subclass(
            DTensor, dtype, size, stride, offset, layout, device, requires_grad
        )
        tensor._local_tensor, tensor._spec = state["_local_tensor"], state["_spec"]
        return tensor

    def new(cls: type, *checks: Callable[[object], bool]) -> _Class:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if cls in (TensorMeta, ShardOrderEntry):
            return _Class(name, cls, lambda args: cls.__new__(cls, *_arguments(name, args, *checks)))
        return _Class(
            name, cls, lambda args: cls.__new__(cls) if args == () else _refuse(f"NEWOBJ of {name} with arguments")
        )

    tensor_v2 = _Function("torch._utils._rebuild_tensor_v2", rebuild_tensor)
    plain_tensor = _Class("torch.Tensor", torch.Tensor, lambda args: _refuse("NEWOBJ of a torch.Tensor"))
    wrapper_subclass = _Function(
        "torch._utils._rebuild_wrapper_subclass",
        lambda args: _refuse("a bare _rebuild_wrapper_subclass call: only a DTensor's _rebuild_from_type_v2 uses it"),
    )
    dtensor = _Class("torch.distributed.tensor.DTensor", DTensor, lambda args: _refuse("NEWOBJ of a DTensor"))
    entries: list[_Function | _Class] = [
        _Function("collections.OrderedDict", lambda args: OrderedDict(*_arguments("OrderedDict", args))),
        _Function("torch.Size", lambda args: torch.Size(*_arguments("torch.Size", args, _dims))),
        _Function(
            "torch.device",
            lambda args: torch.device(
                *_arguments("torch.device", args, _short_str, lambda i: type(i) is int and i >= 0, optional=1)
            ),
        ),
        _Function(
            "torch.serialization._get_layout",
            lambda args: _arguments("_get_layout", args, lambda name: name == "torch.strided") and torch.strided,
        ),
        tensor_v2,
        _Function("torch._utils._rebuild_parameter", rebuild_parameter),
        _Function("torch._tensor._rebuild_from_type_v2", rebuild_from_type),
        wrapper_subclass,
        plain_tensor,
        dtensor,
        new(DTensorSpec),
        new(DeviceMesh),
        new(_MeshLayout),
        new(_FlatLayout),
        *(new(cls) for cls in _PLACEMENTS),
        new(TensorMeta, _nothing_but(torch.Size), _dims, _nothing_but(torch.dtype)),
        new(ShardOrderEntry, lambda d: type(d) is int and d >= 0, _dims),
    ]
    # dtypes and the legacy storage types (FloatStorage, ...) as torch's own allow-list names them
    values = {
        name: value
        for name, value in _get_allowed_globals().items()
        if isinstance(value, (torch.dtype, torch.serialization.StorageType))
    }
    return {**values, **{entry.name: entry for entry in entries}}
