"""Megatron-LM's vocabulary padding: the embedding and output layer carry ``vocab_size`` rounded up to
a multiple of ``make_vocab_size_divisible_by x TP`` rows; the HF model has exactly ``vocab_size``.

The padded rows are cut. They are recognised by shape alone (Megatron initialises them like any row,
so their values tell nothing): the stored row count must be ``vocab_size`` rounded up to a multiple of
a power of two (Megatron's granularity, 128 x TP by default). More rows than that would be trained
rows, and are refused, as is a config with more rows than the checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.output_specs import OutputSpec, Piece
from merge_pipeline.hf.config import text_section

_VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def drop_vocab_padding(
    specs: list[OutputSpec], config: dict, config_path: Path, metadata_path: Path
) -> list[OutputSpec]:
    """``specs`` with the embedding and output layer cut to the config's ``vocab_size`` rows."""
    vocab = text_section(config).get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        return specs
    out = []
    for spec in specs:
        [piece, *rest] = spec.pieces
        rows = piece.rows[1] - piece.rows[0]
        if rest or piece.index or not piece.key.endswith(_VOCAB_TENSORS) or rows in (1, vocab):  # 1: a value head
            out.append(spec)
            continue
        if rows < vocab:
            raise MergeError(
                config_path,
                f"vocab_size {vocab} but the checkpoint's {piece.key} has {rows} rows: pass the trainer's own config (--hf_model_path)",
            )
        granularity = rows & -rows  # the largest power of two dividing the padded row count
        if rows - vocab >= granularity:
            raise MergeError(
                metadata_path,
                f"{piece.key} has {rows} rows, config vocab_size is {vocab}: more than Megatron's padding "
                f"(to a multiple of {granularity}); the rows beyond it would be trained rows, not cut",
            )
        out.append(OutputSpec(spec.name, (Piece(piece.key, (), (piece.rows[0], piece.rows[0] + vocab)),)))
    return out
