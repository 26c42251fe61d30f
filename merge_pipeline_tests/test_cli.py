"""The command line as a user runs it: entry points, inspect, test, flags verl users type."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from merge_pipeline.progress import human_bytes
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli

SPEC = FsdpSpec(world_size=3, with_optimizer=False)


def test_console_script_and_module_entry_points(tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(SPEC).role_dir
    script = shutil.which("merge-pipeline", path=str(Path(sys.executable).parent))
    for i, command in enumerate([[script], [sys.executable, "-m", "merge_pipeline"]]):
        done = subprocess.run(
            [
                *command,
                "merge",
                "--backend",
                "fsdp",
                "--local_dir",
                role_dir,
                "--target_dir",
                tmp_path / f"out{i}",
                "--use_cpu_initialization",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "merged" in done.stdout and (tmp_path / f"out{i}" / "model.safetensors").is_file()
        assert "--use_cpu_initialization is accepted" in done.stderr
        assert "writing weights: 100%" in done.stderr, "plain progress lines when not on a terminal"
        # the progress total is what is written, headers included, as the summary line says
        size = human_bytes((tmp_path / f"out{i}" / "model.safetensors").stat().st_size)
        assert f"writing weights: 100% ({size} of {size}, " in done.stderr, done.stderr
        assert f"{size} of safetensors files" in done.stderr


@pytest.mark.slow
def test_bad_input_exit_code_from_a_real_process(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "merge_pipeline",
            "merge",
            "--local_dir",
            tmp_path / "nope",
            "--target_dir",
            tmp_path / "out",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {tmp_path / 'nope'}: does not exist"


def test_inspect_reads_metadata_only(capsys, fsdp_checkpoint):
    sample = fsdp_checkpoint(SPEC)
    code, out, _ = run_cli(capsys, "inspect", sample.role_dir, "--json")
    info = json.loads(out)
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert code == 0
    assert (info["backend"], info["role"], info["world_size"], info["fsdp_version"]) == ("fsdp", "actor", 3, 2)
    assert info["mesh_shape"] == [3] and info["mesh_dim_names"] == ["fsdp"]
    assert info["parameters"] == sum(t.numel() for t in reference.values())
    assert info["dtypes"] == {"float32": info["parameters"]}
    assert (info["lora"], info["value_model"], info["tied_word_embeddings"]) == (False, False, False)
    assert len(info["files"]) == 3
    code, out, _ = run_cli(capsys, "inspect", sample.role_dir)
    assert code == 0 and "world_size: 3" in out


def test_test_command_passes_and_catches_a_changed_tensor(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(SPEC)
    code, out, _ = run_cli(
        capsys, "test", "--backend", "fsdp", "--local_dir", sample.role_dir, "--test_hf_dir", sample.reference_dir
    )
    assert code == 0 and out.strip().endswith(f"match {sample.reference_dir}")

    changed = tmp_path / "changed"
    changed.mkdir()
    tensors = load_file(sample.reference_dir / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["model.norm.weight"][3] += 0.5
    save_file(tensors, changed / "model.safetensors")
    code, out, err = run_cli(capsys, "test", "--local_dir", sample.role_dir, "--test_hf_dir", changed)
    assert code == 3
    assert "MISMATCH model.norm.weight: max abs diff 0.5" in out and "1 mismatched" in err
    code, out, err = run_cli(capsys, "test", "--local_dir", sample.role_dir, "--test_hf_dir", changed, "--atol", "0.6")
    assert code == 0


def test_test_command_in_reference_dtype(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(SPEC)
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    save_file(
        {n: t.to(torch.bfloat16) for n, t in load_file(sample.reference_dir / "model.safetensors").items()},
        bf16 / "model.safetensors",
    )
    code, out, err = run_cli(capsys, "test", "--local_dir", sample.role_dir, "--test_hf_dir", bf16)
    assert code == 0, err
    assert out.startswith("largest differences (max abs diff, tensor):\n")
    assert out.strip().endswith(f"match {bf16} after casting to bfloat16")  # the fp32 merge is not bf16 itself


def test_unknown_dtype_is_an_argparse_error(capsys, tmp_path, fsdp_checkpoint):
    try:
        run_cli(capsys, "merge", "--local_dir", tmp_path, "--target_dir", tmp_path / "o", "--dtype", "int8")
    except SystemExit as exc:
        assert exc.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_merge_lora_without_lora_is_refused(capsys, tmp_path, fsdp_checkpoint):
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", fsdp_checkpoint(SPEC).role_dir, "--target_dir", tmp_path / "o", "--merge-lora"
    )
    assert code == 1 and "no LoRA tensors" in error_lines(err)[0] and not (tmp_path / "o").exists()
