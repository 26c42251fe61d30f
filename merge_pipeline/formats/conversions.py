"""The operations a name mapping is made of: how stored tensors become Hugging Face tensors.

Megatron-Core's mapping (``formats/megatron/names.py``, and Megatron-Bridge's recorded kinds through
``formats/megatron/bridge_table.py``) and torchtitan's (``formats/dcp/torchtitan_names.py``) are tables from a
stored name to one of these operations, in the spirit of transformers' ``conversion_mapping`` (rename, chunk,
concatenate, permute for rope, transpose): the same kind of mapping is spelled once, here. An operation says
which rows of which stored tensors make up each HF tensor (``output_specs``); none reads a byte.

- ``Rename``: the stored tensor as it is.
- ``Chunk``: a gated MLP's fc1, its rows halved into gate and up.
- ``SplitQKV``: fused q/k/v rows grouped per KV group ``[q heads | k | v]``, split into three tensors (or two,
  where the HF model has no V of its own); with megatron-core's attention output gate ``[q heads | gate heads | k |
  v]``, each head's gate rows after its q rows.
- ``RegroupQKV``: fused q/k/v rows grouped per head, as one tensor ``[all q; all k; all v]``.
- ``Concatenate``: several stored tensors' rows, in order, as one tensor.
- ``ConcatenateParts``: a fused tensor saved as named parts (Mamba's ``in_proj.weight.z``, ``.x``, ...), in its order,
  or group by group (Qwen3-Next's in_proj_qkvz: ``[q | k | v | z]`` per key head).
- ``AddOne``: the stored tensor plus one (a zero-centred norm weight as a standard norm's).
- ``PerExpert``: experts stacked on the leading dimension, one HF tensor each.
- ``GroupedExperts``: every expert of a layer as one tensor, each matrix transposed (gpt-oss's layout).
- ``PermuteForRope``: q/k rows stored in torchtitan's rotary order, in HF's.
- ``Reshape``: the same bytes under another shape.
- ``Transpose``: a 2-D tensor transposed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.output_specs import OutputSpec, Piece, whole


@dataclass(frozen=True)
class Stored:
    """One stored tensor as a mapping sees it: its key and shape, and the leading ``index`` (layer, expert)
    of the copy an HF tensor takes; its rows are counted on the dimension after the index."""

    key: str
    shape: tuple[int, ...]
    index: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return self.shape[len(self.index)]

    def piece(self, start: int = 0, stop: int | None = None) -> Piece:
        return Piece(self.key, self.index, (start, self.rows if stop is None else stop))

    def at(self, index: int) -> Stored:
        """The copy at ``index`` on the next leading dimension (an expert of stacked experts)."""
        return Stored(self.key, self.shape, (*self.index, index))


@dataclass(frozen=True)
class Sizes:
    """The model's sizes the operations split by, and the files to name when a stored tensor disagrees."""

    config_path: Path
    metadata_path: Path
    attention_heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    vision_heads: int | None = None
    linear_key_heads: int = 0  # Gated DeltaNet's key heads (linear_num_key_heads)


def named(operation: Operation, fill: Callable[[str], str]) -> Operation:
    """``operation`` with each HF name it holds passed through ``fill`` (a table's names are inside a layer)."""
    return replace(
        operation, **{f.name: fill(v) for f in fields(operation) if isinstance(v := getattr(operation, f.name), str)}
    )


@dataclass(frozen=True)
class Rename:
    name: str

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        return [whole(self.name, stored.key, stored.rows, stored.index)]


@dataclass(frozen=True)
class Chunk:
    """A gated MLP's fc1: the first half of its rows is the gate, the second half the up projection."""

    gate: str
    up: str

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        if stored.rows % 2:
            raise MergeError(sizes.metadata_path, f"{stored.key}: gated fc1 has an odd number of rows ({stored.rows})")
        half = stored.rows // 2
        return [OutputSpec(self.gate, (stored.piece(0, half),)), OutputSpec(self.up, (stored.piece(half),))]


def _row_groups(stored: Stored, groups: int, blocks: tuple[int, ...]) -> list[tuple[Piece, ...]]:
    """Rows stored as ``groups`` repeats of consecutive blocks of these sizes: each block's rows over the groups."""
    size = sum(blocks)
    starts = [sum(blocks[:b]) for b in range(len(blocks))]
    return [
        tuple(stored.piece(g * size + start, g * size + start + rows) for g in range(groups))
        for start, rows in zip(starts, blocks, strict=True)
    ]


@dataclass(frozen=True)
class SplitQKV:
    """Fused QKV rows grouped per KV group: [q heads of g | k_g | v_g] for each group g. With ``output_gate``, rows that
    also hold megatron-core's attention output gate (told by their count) are split as ``_gated`` says: the bridge's
    QKVMapping reads them by its provider's ``attention_output_gate``, which its table does not record. ``absent``:
    the roles (``"v"``) the HF model does not hold (Gemma 4's K = V layers: their V exists only in Megatron)."""

    q: str
    k: str
    v: str
    output_gate: bool = False
    absent: tuple[str, ...] = ()

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        heads, kv_heads, head_dim = sizes.attention_heads, sizes.kv_heads, sizes.head_dim
        if heads % kv_heads:
            raise MergeError(
                sizes.config_path,
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}",
            )
        q_rows = heads // kv_heads * head_dim
        group_rows = q_rows + 2 * head_dim
        if self.output_gate and stored.rows == kv_heads * (group_rows + q_rows):
            q, k, v = self._gated(stored, heads // kv_heads, q_rows, head_dim)
        elif stored.rows == kv_heads * group_rows:
            q, k, v = _row_groups(stored, kv_heads, (q_rows, head_dim, head_dim))
        else:
            raise MergeError(
                sizes.config_path,
                f"sizes disagree with the checkpoint: {stored.key} has {stored.rows} rows, but {heads} heads, "
                f"{kv_heads} KV heads and head_dim {head_dim} need {kv_heads * group_rows}",
            )
        roles = {"q": OutputSpec(self.q, q), "k": OutputSpec(self.k, k), "v": OutputSpec(self.v, v)}
        return [spec for role, spec in roles.items() if role not in self.absent]

    def _gated(self, stored: Stored, heads_per_group: int, q_rows: int, head_dim: int) -> tuple[tuple, tuple, tuple]:
        """megatron-core's ``attention_output_gate`` (Qwen3-Next, Qwen3.5): per KV group [q heads | gate heads | k | v],
        the gate a second q of each head; HF's q_proj holds each head's q rows then its gate rows."""
        group_rows = 2 * q_rows + 2 * head_dim
        groups = stored.rows // group_rows
        q = tuple(
            stored.piece(start, start + head_dim)
            for g in range(groups)
            for h in range(heads_per_group)
            for start in (g * group_rows + h * head_dim, g * group_rows + q_rows + h * head_dim)
        )
        k, v = _row_groups(stored, groups, (2 * q_rows, head_dim, head_dim))[1:]
        return q, k, v


@dataclass(frozen=True)
class RegroupQKV:
    """A vision tower's fused QKV: rows grouped per head [q_h | k_h | v_h], HF wants [all q; all k; all v]."""

    name: str

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        heads = sizes.vision_heads
        if not heads or stored.rows % (3 * heads):
            raise MergeError(
                sizes.config_path,
                f"sizes disagree with the checkpoint: {stored.key} has {stored.rows} rows, not 3 x vision_config.num_heads ({heads}) x head_dim",
            )
        head_dim = stored.rows // (3 * heads)
        q, k, v = _row_groups(stored, heads, (head_dim, head_dim, head_dim))
        return [OutputSpec(self.name, q + k + v)]


@dataclass(frozen=True)
class Concatenate:
    """Several stored tensors' rows, in order, as one HF tensor; the mapping gathers the parts."""

    name: str

    def of(self, parts: list[Stored]) -> OutputSpec:
        return OutputSpec(self.name, tuple(part.piece() for part in parts))


@dataclass(frozen=True)
class ConcatenateParts:
    """A fused tensor saved as named parts, each whole (megatron-core's Mamba mixer: ``in_proj.weight.z``, ``.x``,
    ``.B``, ``.C``, ``.dt``, each gathered over tensor parallelism): HF's tensor is the parts' rows in ``parts`` order.
    The mapping gathers the parts by name; every part must be there, and no other. ``per_key_head``: each part's rows
    are one block per key head (``Sizes.linear_key_heads``), and HF's tensor holds them head by head, every part's
    block of head 0 in order, then of head 1 (Gated DeltaNet's in_proj, saved by megatron-core as query, key, value,
    z, beta and alpha: Qwen3-Next's in_proj_qkvz is [q_h | k_h | v_h | z_h] for each key head h)."""

    name: str
    parts: tuple[str, ...]
    per_key_head: bool = False

    def of(self, found: dict[str, Stored], sizes: Sizes) -> OutputSpec:
        if sorted(found) != sorted(self.parts):
            raise MergeError(
                sizes.metadata_path,
                f"{self.name}: the checkpoint holds the parts {', '.join(sorted(found))}, not {', '.join(self.parts)}",
            )
        stored = [found[part] for part in self.parts]
        widths = {part.shape[len(part.index) + 1 :] for part in stored}
        if len(widths) != 1:
            raise MergeError(
                sizes.metadata_path, f"{self.name}: its parts' shapes differ past the rows ({stored[0].key})"
            )
        groups = sizes.linear_key_heads if self.per_key_head else 1
        if groups < 1:
            raise MergeError(sizes.config_path, f"{self.name}: linear_num_key_heads is missing")
        for part in stored:
            if part.rows % groups:
                raise MergeError(
                    sizes.metadata_path, f"{part.key}: {part.rows} rows do not split into {groups} key heads"
                )
        return OutputSpec(
            self.name,
            tuple(
                part.piece(g * part.rows // groups, (g + 1) * part.rows // groups)
                for g in range(groups)
                for part in stored
            ),
        )


@dataclass(frozen=True)
class AddOne:
    """The stored tensor plus one, in its own dtype: a zero-centred norm weight (megatron-core's
    ``layernorm_zero_centered_gamma``) as the standard norm's HF keeps (Qwen3-Next's gated out norm)."""

    name: str

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        return [replace(whole(self.name, stored.key, stored.rows, stored.index), add_one=True)]


@dataclass(frozen=True)
class PerExpert:
    """Experts stacked on the leading dimension [E, ...]: expert ``e`` is HF tensor ``name.format(e)``."""

    name: str

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        experts = stored.shape[len(stored.index)]
        return [out for e in range(experts) for out in Rename(self.name.format(e)).outputs(stored.at(e), sizes)]


@dataclass(frozen=True)
class GroupedExperts:
    """Every expert of a layer as one HF tensor [E, ...] in HF's transposed layout (formats/expert_matrices.py):
    each expert's matrix transposed (a bias as it is), its [gate; up] row halves interleaved first if asked."""

    name: str
    transpose: bool = True
    interleave_halves: bool = False

    def of(self, pieces: tuple[Piece, ...], experts: int) -> OutputSpec:
        return OutputSpec(
            self.name, pieces, experts=experts, transpose=self.transpose, interleave_halves=self.interleave_halves
        )

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        """Experts stacked as one stored tensor [E, out, in]."""
        if len(stored.shape) != 3:
            raise MergeError(sizes.metadata_path, f"{stored.key}: shape {stored.shape} is not [experts, out, in]")
        experts = stored.shape[0]
        return [self.of(tuple(stored.at(e).piece() for e in range(experts)), experts)]


@dataclass(frozen=True)
class PermuteForRope:
    """q (or k, ``kv``) rows stored per head in torchtitan's rotary order (formats/rotary_rows.py), in HF's."""

    name: str
    kv: bool = False

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        heads = sizes.kv_heads if self.kv else sizes.attention_heads
        if stored.rows % (2 * heads):
            raise MergeError(
                sizes.metadata_path, f"{stored.key}: {stored.rows} rows do not split into {heads} rotary heads"
            )
        return [OutputSpec(self.name, (stored.piece(),), rotary_heads=heads)]


@dataclass(frozen=True)
class Reshape:
    """The same bytes in the same order under another shape (a Linear patch embedding as HF's Conv weight)."""

    name: str
    shape: tuple[int, ...]

    def of(self, pieces: tuple[Piece, ...]) -> OutputSpec:
        return OutputSpec(self.name, pieces, shape=self.shape)


@dataclass(frozen=True)
class Unsqueeze:
    """The tensor as stored under a leading dimension of 1 (ERNIE 4.5's expert bias: Megatron [n], HF [1, n])."""

    name: str

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        return [OutputSpec(self.name, (stored.piece(),), shape=(1, *stored.shape[len(stored.index) :]))]


@dataclass(frozen=True)
class Transpose:
    """A 2-D tensor transposed (Gemma 3's projector: Megatron's Linear weight [out, in], HF's [in, out] that
    ``x @ W`` multiplies): streamed as grouped experts' layout of one expert, under the matrix's own shape."""

    name: str

    def outputs(self, stored: Stored, sizes: Sizes) -> list[OutputSpec]:
        matrix = stored.shape[len(stored.index) :]
        if len(matrix) != 2:
            raise MergeError(sizes.metadata_path, f"{stored.key}: shape {matrix} is not a matrix to transpose")
        rows, columns = matrix
        return [OutputSpec(self.name, (stored.piece(),), shape=(columns, rows), experts=1, transpose=True)]


# The operations that turn one stored tensor into HF tensors (a table's entries).
Operation = (
    Rename
    | Chunk
    | SplitQKV
    | RegroupQKV
    | PerExpert
    | GroupedExperts
    | PermuteForRope
    | Unsqueeze
    | Transpose
    | AddOne
)
