"""``merge-pipeline diff``: a LoRA merge left unfolded is its base model bit for bit; folded, exactly the LoRA targets change."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from merge_pipeline.hf.step_diff import diff_folders
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli

LORA = FsdpSpec(lora=(4, 8))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def merged(capsys, sample, out, *flags) -> None:
    code, _, err = run_cli(capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", out, *flags)
    assert code == 0, err


def test_diff_finds_an_unfolded_lora_and_measures_a_folded_one(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA)
    base = sample.reference_dir / "base"
    merged(capsys, sample, tmp_path / "unfolded")
    merged(capsys, sample, tmp_path / "folded", "--merge-lora")

    assert diff_folders(tmp_path / "unfolded", {"base": base}).identical_to("base")
    diff = diff_folders(tmp_path / "folded", {"base": base})
    assert not diff.identical_to("base") and diff.nan == diff.inf == 0
    changed = {t.name for t in diff.tensors if t.relative_change["base"] != 0.0}
    assert changed and all(any(target in name for target in TARGETS) for name in changed)
    folded, before = load_file(tmp_path / "folded" / "model.safetensors"), load_file(base / "model.safetensors")
    for t in diff.tensors:  # the streamed numbers are the whole-tensor ones
        expected = torch.linalg.vector_norm(folded[t.name] - before[t.name]) / torch.linalg.vector_norm(before[t.name])
        assert abs(t.relative_change["base"] - float(expected)) <= 1e-6 * max(float(expected), 1e-12), t.name
        assert t.norm == float(torch.linalg.vector_norm(folded[t.name].float()))

    code, out, _ = run_cli(capsys, "diff", base, tmp_path / "unfolded")
    assert code == 0 and "vs before: bit-identical" in out
    code, out, _ = run_cli(capsys, "diff", base, tmp_path / "folded")
    assert code == 0 and "vs before: largest relative change" in out
    assert "| tensor | shape | norm | NaN | Inf | change vs before |" in out
    assert out.count("| identical |") == len(diff.tensors) - len(changed)


def test_diff_of_a_folder_without_weights_is_one_line(capsys, tmp_path, fsdp_checkpoint):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, "diff", tmp_path / "empty", fsdp_checkpoint(LORA).reference_dir / "base")
    assert code == 1 and error_lines(err) == [
        f"error: {tmp_path / 'empty'}: no model*.safetensors weights to compare (not a merged Hugging Face folder)"
    ]
