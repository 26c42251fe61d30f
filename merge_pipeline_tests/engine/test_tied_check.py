"""Tying drops lm_head.weight: only when it holds exactly the embedding's bytes, never silently.

The untied FSDP fixture is a real save whose lm_head differs from the embeddings; its
config.json is switched to tie_word_embeddings true on disk, as a mismatched config would be.
"""

from __future__ import annotations

import json

import torch
import transformers
from safetensors.torch import load_file

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import (
    config_says_tied,
    error_lines,
    load_safetensors_dir,
    merge,
    same_bits,
    tree_digest,
)

UNTIED = FsdpSpec()
TIED = FsdpSpec(tie_word_embeddings=True)


def test_tied_config_with_a_trained_lm_head_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(UNTIED))
    config = config_says_tied(sample.role_dir)
    before = tree_digest(sample.role_dir)
    code, _, err = merge(capsys, sample.role_dir, tmp_path / "out")
    assert code == 1 and "Traceback" not in err
    [line] = error_lines(err)
    assert f"{config}: tie_word_embeddings is true but lm_head.weight differs from model.embed_tokens.weight" in line, (
        line
    )
    assert "--untie-word-embedding" in line
    assert tree_digest(sample.role_dir) == before and not (tmp_path / "out").exists()


def test_tie_flag_on_an_untied_checkpoint_is_refused(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(UNTIED)
    code, _, err = merge(capsys, sample.role_dir, tmp_path / "out", "--tie-word-embedding")
    assert code == 1
    [line] = error_lines(err)
    assert (
        f"{sample.role_dir}: --tie-word-embedding given but lm_head.weight differs from model.embed_tokens.weight"
        in line
    ), line


def test_untie_flag_keeps_the_trained_lm_head(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(UNTIED))
    config_says_tied(sample.role_dir)
    code, _, err = merge(capsys, sample.role_dir, tmp_path / "out", "--untie-word-embedding")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False
    reference = load_file(sample.reference_dir / "model.safetensors")
    merged = load_safetensors_dir(tmp_path / "out")
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert same_bits(model.lm_head.weight.detach(), reference["lm_head.weight"])


def test_equal_lm_head_stored_separately_is_compared_and_dropped(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    """lm_head saved as its own copy of the embedding (not a shared storage): compared piece by piece."""
    sample = fresh_copy(fsdp_checkpoint(UNTIED))
    config_says_tied(sample.role_dir)
    for path in sample.role_dir.glob("model_world_size_*_rank_*.pt"):
        state, second_copy = torch.load(path, weights_only=True), torch.load(path, weights_only=True)
        state["lm_head.weight"] = second_copy["model.embed_tokens.weight"]  # same bytes, its own storage
        torch.save(state, path)
    code, _, err = merge(capsys, sample.role_dir, tmp_path / "out")
    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")
    assert "lm_head.weight" not in merged
    assert same_bits(
        merged["model.embed_tokens.weight"],
        load_file(sample.reference_dir / "model.safetensors")["model.embed_tokens.weight"],
    )


def test_tied_checkpoint_still_drops_its_shared_lm_head(capsys, tmp_path, fsdp_checkpoint):
    code, _, err = merge(capsys, fsdp_checkpoint(TIED).role_dir, tmp_path / "out")
    assert code == 0, err
    assert "lm_head.weight" not in load_safetensors_dir(tmp_path / "out")


def test_tie_and_untie_together_are_refused(capsys, tmp_path, fsdp_checkpoint):
    code, _, err = merge(
        capsys, fsdp_checkpoint(TIED).role_dir, tmp_path / "out", "--tie-word-embedding", "--untie-word-embedding"
    )
    assert code == 1
    [line] = error_lines(err)
    assert "contradict" in line
