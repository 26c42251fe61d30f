"""Megatron folders as today's writers leave them, on a real megatron-core v2 sample (TP=2, no HF files):

- verl creates ``model/huggingface/`` even when it saves no HF files (``use_dist_checkpointing``
  without ``hf_model``): an empty folder there means "no config", so the one-line error names
  ``--hf_model_path``.
- Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP``: the sample's
  128 rows are what Megatron-LM stores for a vocabulary of 100 (padded to 128); the merge keeps exactly
  ``vocab_size`` rows, refuses to cut rows that are not padding, and says so when the config has more
  rows than the checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.megatron.vocab import drop_vocab_padding
from merge_pipeline.formats.output_specs import OutputSpec, Piece
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, merge, same_bits, tree_digest

VOCAB_ROWS = ("model.embed_tokens.weight", "lm_head.weight")


@pytest.fixture
def role(megatron_v2_sample, tmp_path) -> Path:
    role = tmp_path / "actor"
    shutil.copytree(megatron_v2_sample.role_dir, role)
    return role


def original_with_vocab(megatron_v2_sample, folder: Path, vocab_size: int) -> Path:
    shutil.copytree(megatron_v2_sample.original_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    return folder


def test_empty_model_huggingface_folder_asks_for_hf_model_path(megatron_v2_sample, role, tmp_path, capsys):
    (role / "model" / "huggingface").mkdir()
    before = tree_digest(role)

    code, _, err = merge(capsys, role, tmp_path / "out")
    assert code == 1
    [line] = error_lines(err)
    assert "--hf_model_path" in line and "model/huggingface/config.json" in line, line
    assert not (tmp_path / "out").exists() and tree_digest(role) == before

    code, _, err = merge(capsys, role, tmp_path / "out", "--hf_model_path", megatron_v2_sample.original_dir)
    assert code == 0, err


def test_padded_vocabulary_merges_with_exactly_vocab_size_rows(megatron_v2_sample, role, tmp_path, capsys):
    reference = load_file(megatron_v2_sample.reference_dir / "model.safetensors")
    assert reference["model.embed_tokens.weight"].shape[0] == 128
    original = original_with_vocab(megatron_v2_sample, tmp_path / "original", 100)

    code, _, err = merge(capsys, role, tmp_path / "out", "--hf_model_path", original)
    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor[:100] if name in VOCAB_ROWS else tensor), name


def test_config_with_more_rows_than_the_checkpoint_is_one_line(megatron_v2_sample, role, tmp_path, capsys):
    original = original_with_vocab(megatron_v2_sample, tmp_path / "original", 130)
    code, _, err = merge(capsys, role, tmp_path / "out", "--hf_model_path", original)
    assert code == 1
    [line] = error_lines(err)
    assert "vocab_size 130" in line and "128 rows" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("rows", "vocab"), [(200, 100), (384, 200)])
def test_rows_beyond_megatrons_padding_are_never_cut(rows, vocab):
    """200 rows are no rounding of 100 to a power-of-two multiple (8 divides 200, 100 rows more); nor
    are 384 of 200 (128 divides 384, 184 rows more): cutting them would drop trained rows."""
    spec = OutputSpec("model.embed_tokens.weight", (Piece("embedding.word_embeddings.weight", (), (0, rows)),))
    with pytest.raises(MergeError, match="more than Megatron's padding"):
        drop_vocab_padding([spec], {"vocab_size": vocab}, Path("config.json"), Path(".metadata"))
