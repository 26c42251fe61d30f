"""`merge-pipeline merge --backend megatron` end to end: bit-exact files that transformers loads and
that compute what megatron-core computed."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from merge_pipeline_samples.megatron import sample_tokens
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, merge_ok, run_cli, same_bits, tree_digest


@pytest.mark.parametrize("name", ["qwen2_tp2", "qwen3_tp2", "qwen2_moe_ep2", "qwen3_moe_tp2_per_layer"])
def test_merged_model_reproduces_megatron_logits(megatron_samples, tmp_path, capsys, name):
    """The strongest check: megatron-core's own forward pass (TP / EP ranks, gloo) on the same tokens
    agrees with transformers running the merged folder. A wrong QKV split, gate/up order, expert
    index or norm would change the logits far beyond float rounding."""
    sample = megatron_samples[name]
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "megatron")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(sample_tokens()[None]).logits[0]
    expected = torch.load(sample.logits_path, weights_only=True)
    assert expected.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "name", ["llama_tied_pp2", "qwen2_pp2_vpp2", "deepseek_v3_mla", "qwen2_5_vl", "qwen2_hf_weights"]
)
def test_merge_is_bit_exact_and_loads(megatron_samples, tmp_path, capsys, name):
    sample = megatron_samples[name]
    before = tree_digest(sample.role_dir)
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "auto")
    merged = load_safetensors_dir(tmp_path / "out")
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert set(merged) == set(reference)
    assert all(same_bits(merged[k], reference[k]) for k in reference)
    config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    model_class = getattr(transformers, config.architectures[0])
    model_class.from_pretrained(tmp_path / "out")  # every tensor has a home, none is missing
    assert tree_digest(sample.role_dir) == before


def test_tied_output_has_no_lm_head_and_says_tied(megatron_samples, tmp_path, capsys):
    merge_ok(capsys, megatron_samples["llama_tied_pp2"].role_dir, tmp_path / "out", "--backend", "megatron")
    assert "lm_head.weight" not in load_safetensors_dir(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is True


def test_value_model_merges_to_token_classification(megatron_samples, tmp_path, capsys):
    sample = megatron_samples["qwen2_value"]
    merge_ok(capsys, sample.role_dir, tmp_path / "out", "--backend", "megatron", "--is-value-model")
    model = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "out").eval()
    assert model.config.num_labels == 1
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert same_bits(model.score.weight.detach(), reference["score.weight"])
    assert model.score.bias.abs().sum() == 0


def test_test_command_confirms_the_reference(megatron_samples, capsys):
    sample = megatron_samples["qwen3_moe_tp2_per_layer"]
    code, out, err = run_cli(
        capsys, "test", "--backend", "megatron", "--local_dir", sample.role_dir, "--test_hf_dir", sample.reference_dir
    )
    assert code == 0, err
    assert "match" in out


def test_bad_input_exits_with_one_line_and_no_target(fresh_megatron, tmp_path, capsys):
    sample = fresh_megatron("qwen2_tp2")
    victim = sorted((sample.role_dir / "dist_ckpt").glob("*.distcp"))[0]
    victim.unlink()
    before = tree_digest(sample.role_dir)
    code, _, err = run_cli(
        capsys,
        "merge",
        "--backend",
        "megatron",
        "--local_dir",
        sample.role_dir,
        "--target_dir",
        tmp_path / "out",
        "--no-progress",
    )
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1 and victim.name in lines[0]
    assert not (tmp_path / "out").exists()
    assert tree_digest(sample.role_dir) == before
