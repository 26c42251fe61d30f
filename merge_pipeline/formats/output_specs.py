"""An HF tensor as rows of stored tensors: what a name mapping produces and the DCP planner reads.

Every family's mapping (``formats/megatron/names.py``, ``formats/dcp/torchtitan_names.py``) says, per HF
tensor, which rows of which stored tensors make it up; ``formats/dcp_files.py`` turns that into byte ranges.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Rows ``rows[0]:rows[1]`` of stored tensor ``key`` at fixed leading ``index`` (layer, expert).

    The rows are counted on dimension ``len(index)``; every later dimension is taken whole.
    """

    key: str
    index: tuple[int, ...]
    rows: tuple[int, int]


@dataclass(frozen=True)
class OutputSpec:
    """One HF tensor: its pieces concatenated along the row dimension."""

    name: str
    pieces: tuple[Piece, ...]
    # The same bytes in the same order under another shape (a Linear patch embedding saved as HF's Conv weight),
    # or a transposed matrix's shape (one expert of ``experts`` below).
    shape: tuple[int, ...] | None = None
    # torchtitan's q/k: the rows of each of this many heads stored in its rotary order (formats/rotary_rows.py).
    rotary_heads: int | None = None
    # Grouped experts in HF's transposed layout (formats/expert_matrices.py): the pieces are this many
    # equal expert matrices, each written transposed (a bias as it is), its [gate; up] halves
    # interleaved first if asked; the HF tensor is [experts, ...].
    experts: int | None = None
    transpose: bool = False
    interleave_halves: bool = False
    # Each value plus one, in the stored dtype (formats/conversions.py's AddOne: a zero-centred norm weight).
    add_one: bool = False


def whole(name: str, key: str, rows: int, index: tuple[int, ...] = ()) -> OutputSpec:
    """HF tensor ``name`` is stored tensor ``key`` (at ``index``) as it is: all its ``rows``."""
    return OutputSpec(name, (Piece(key, index, (0, rows)),))
