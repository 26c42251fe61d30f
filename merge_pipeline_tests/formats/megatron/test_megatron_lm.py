"""Megatron-LM's own save folders, pointed at as a Megatron-LM user would: ``<save>/iter_0000100/`` or
``<save>/`` with its tracker ``latest_checkpointed_iteration.txt``, merged with ``--backend auto``.

Megatron-LM is not installable here, so the fixture is reproduced from Megatron-LM source at
NVIDIA/Megatron-LM d98e8a64 (megatron/training/checkpointing.py: ``save_checkpoint``,
``generate_state_dict``, ``get_checkpoint_name``): megatron-core 0.16 itself builds the GPT model
(TP=2, two gloo ranks on CPU) and saves ``args``, ``checkpoint_version``, ``iteration`` and the model's
sharded state dict under ``model`` with ``dist_checkpointing.save`` (``megatron_worker._save_as_megatron_lm``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from merge_pipeline_samples.megatron import MEGATRON_LM_ITERATION
from merge_pipeline_tests.formats.megatron.test_release_gaps import VOCAB_ROWS, original_with_vocab
from merge_pipeline_tests.formats.megatron.test_verl_v2 import logits
from merge_pipeline_tests.helpers import (
    assert_bit_exact,
    load_safetensors_dir,
    merge_error,
    merge_ok,
    run_cli,
    same_bits,
    tree_digest,
)

ITERATION = f"iter_{MEGATRON_LM_ITERATION:07d}"


def test_iteration_folder_merges_bit_exact_with_megatron_logits(megatron_lm_sample, tmp_path, capsys):
    sample = megatron_lm_sample
    iteration = sample.role_dir / ITERATION
    assert {"metadata.json", "common.pt", ".metadata"} <= {p.name for p in iteration.iterdir()}
    assert (sample.role_dir / "latest_checkpointed_iteration.txt").read_text() == str(MEGATRON_LM_ITERATION)
    before = tree_digest(sample.role_dir)

    merge_ok(capsys, iteration, tmp_path / "out", "--hf_model_path", sample.original_dir)
    assert_bit_exact(tmp_path / "out", sample.reference_dir)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (sample.original_dir / "tokenizer.json").read_bytes()
    torch.testing.assert_close(
        logits(tmp_path / "out"), torch.load(sample.logits_path, weights_only=True), atol=2e-5, rtol=2e-5
    )
    source = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())["source"]
    assert source["backend"] == "megatron" and {Path(i["path"]).suffix for i in source["inputs"]} == {".distcp"}
    code, out, err = run_cli(capsys, "inspect", iteration, "--json", "--hf_model_path", sample.original_dir)
    assert code == 0, err
    info = json.loads(out)
    assert (info["layout_schema"], info["model_weights"], info["tp"]) == ("megatron-lm", str(iteration), 2)
    assert tree_digest(sample.role_dir) == before


def test_save_folder_merges_the_iteration_its_tracker_names(megatron_lm_sample, tmp_path, capsys):
    save = tmp_path / "checkpoints"
    shutil.copytree(megatron_lm_sample.role_dir, save)
    (save / "iter_0000050").mkdir()  # an older save, unfinished: not the one the tracker names
    (save / "iter_0000050" / "metadata.json").write_text("{}")
    flags = ("--hf_model_path", megatron_lm_sample.original_dir)

    merge_ok(capsys, save, tmp_path / "out", *flags)
    assert_bit_exact(tmp_path / "out", megatron_lm_sample.reference_dir)

    (save / "latest_checkpointed_iteration.txt").write_text("200\n")
    line = merge_error(capsys, save, tmp_path / "missing", *flags)
    assert "latest_checkpointed_iteration.txt" in line and "iter_0000200/ is missing" in line, line
    assert "iter_0000050, iter_0000100" in line and "--local_dir" in line, line

    (save / "latest_checkpointed_iteration.txt").write_text("release")
    line = merge_error(capsys, save, tmp_path / "release", *flags)
    assert "names release but release/ is missing" in line, line


def test_without_hf_model_path_one_line_says_what_to_pass(megatron_lm_sample, tmp_path, capsys):
    before = tree_digest(megatron_lm_sample.role_dir)
    for folder in (megatron_lm_sample.role_dir, megatron_lm_sample.role_dir / ITERATION):
        line = merge_error(capsys, folder, tmp_path / folder.name)
        assert ITERATION in line and "Megatron-LM" in line and "--hf_model_path" in line, line
    assert tree_digest(megatron_lm_sample.role_dir) == before


def test_bridge_hf_export_in_the_iteration_gives_the_config(megatron_lm_sample, tmp_path, capsys):
    """Megatron-Bridge's ``also_save_hf_checkpoint`` puts the HF model into ``iter_N/hf/`` (reproduced
    here with the model's config and tokenizer): no --hf_model_path needed."""
    iteration = tmp_path / "checkpoints" / ITERATION
    shutil.copytree(megatron_lm_sample.role_dir / ITERATION, iteration)
    shutil.copytree(megatron_lm_sample.original_dir, iteration / "hf")
    merge_ok(capsys, iteration, tmp_path / "out")
    assert_bit_exact(tmp_path / "out", megatron_lm_sample.reference_dir)
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_legacy_torch_format_is_refused_in_one_line(tmp_path, capsys):
    iteration = tmp_path / "checkpoints" / ITERATION
    (iteration / "mp_rank_00").mkdir(parents=True)
    (iteration / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    line = merge_error(capsys, iteration, tmp_path / "out")
    assert "--ckpt-format torch_dist" in line and ITERATION in line, line


def test_padded_vocabulary_merges_with_exactly_vocab_size_rows(megatron_lm_sample, tmp_path, capsys):
    """Megatron-LM pads the vocabulary to ``make_vocab_size_divisible_by`` x TP: the 128 rows saved
    (64 x TP 2) for a model whose config says 100 merge as exactly its 100 rows."""
    original = original_with_vocab(megatron_lm_sample, tmp_path / "original", 100)
    merge_ok(capsys, megatron_lm_sample.role_dir, tmp_path / "out", "--hf_model_path", original)
    merged = load_safetensors_dir(tmp_path / "out")
    reference = load_file(megatron_lm_sample.reference_dir / "model.safetensors")
    assert set(merged) == set(reference) and reference["model.embed_tokens.weight"].shape[0] == 128
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor[:100] if name in VOCAB_ROWS else tensor), name
