"""Nothing leaks and nothing blocks: side files only from inside the checkpoint, regular files only.

Every case mutates a real FSDP checkpoint on disk and runs the CLI against an existing good target
with ``--overwrite``: exit 1, one line naming the file, inputs untouched, the target unchanged.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from merge_pipeline.engine.hf_folder import copy_side_files
from merge_pipeline.errors import MergeError
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, run_cli, same_bits, tree_digest

SPEC = FsdpSpec(world_size=3, with_optimizer=False)
SECRET = "HF_TOKEN=hf_fake_secret_that_must_never_be_copied"


def secret_outside(tmp_path):
    outside = tmp_path / "elsewhere" / "environ"
    outside.parent.mkdir()
    outside.write_text(SECRET)
    return outside


def merge_fails_cleanly(capsys, sample, target, bad_file, problem, *extra) -> str:
    """Merge over ``target``; assert the clean one-line failure and return stdout + stderr."""
    inputs_before, target_before = tree_digest(sample.role_dir), tree_digest(target)
    code, out, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", target, "--overwrite", "--no-progress", *extra
    )
    assert code == 1, err
    [line] = error_lines(err)
    assert line.startswith(f"error: {bad_file}: ") and problem in line, line
    assert "Traceback" not in err
    assert tree_digest(sample.role_dir) == inputs_before
    assert tree_digest(target) == target_before
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name], "no staging or lock left behind"
    return out + err


def test_symlink_to_a_secret_outside_the_checkpoint_is_refused(
    capsys, tmp_path, fsdp_checkpoint, fresh_copy, good_target
):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    link = sample.role_dir / "huggingface" / "tokenizer_config.json"
    link.unlink()
    link.symlink_to(secret_outside(tmp_path))

    printed = merge_fails_cleanly(capsys, sample, good_target, link, "outside the checkpoint folder")

    assert SECRET not in printed
    for path in good_target.parent.rglob("*"):
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_symlink_to_proc_environ_is_refused(capsys, fsdp_checkpoint, fresh_copy, good_target, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_another_fake_secret")
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    link = sample.role_dir / "huggingface" / "chat_template.jinja"
    link.unlink(missing_ok=True)
    link.symlink_to("/proc/self/environ")

    printed = merge_fails_cleanly(capsys, sample, good_target, link, "is a symlink to /proc/")
    assert "hf_another_fake_secret" not in printed


def test_config_json_symlinked_outside_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy, good_target):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    config = sample.role_dir / "huggingface" / "config.json"
    outside = tmp_path / "elsewhere.json"
    config.rename(outside)
    config.symlink_to(outside)

    merge_fails_cleanly(capsys, sample, good_target, config, "outside the checkpoint folder")


def test_symlink_inside_the_checkpoint_is_copied_as_a_file(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    hf_dir = sample.role_dir / "huggingface"
    shared = sample.role_dir / "shared_tokenizer_config.json"
    (hf_dir / "tokenizer_config.json").rename(shared)
    (hf_dir / "tokenizer_config.json").symlink_to("../shared_tokenizer_config.json")

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--no-progress"
    )

    assert code == 0, err
    copied = tmp_path / "out" / "tokenizer_config.json"
    assert not copied.is_symlink() and copied.read_bytes() == shared.read_bytes()
    merged = load_safetensors_dir(tmp_path / "out")
    for name, tensor in load_file(sample.reference_dir / "model.safetensors").items():
        assert same_bits(merged[name], tensor), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name",
    ["huggingface/special_tokens_map.json", "model_world_size_3_rank_1.pt", "fsdp_config.json"],
    ids=["side_file", "rank_file", "json_file"],
)
def test_fifo_is_refused_without_blocking(capsys, fsdp_checkpoint, fresh_copy, good_target, name):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    fifo = sample.role_dir / name
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)

    merge_fails_cleanly(capsys, sample, good_target, fifo, "is a FIFO, not a regular file")


def test_side_file_over_the_size_cap_is_refused_until_the_cap_is_raised(
    capsys, tmp_path, fsdp_checkpoint, fresh_copy, good_target
):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    big = sample.role_dir / "huggingface" / "tokenizer.json"
    size = big.stat().st_size
    assert size > 2000, "the sample tokenizer must be bigger than the small cap below"

    merge_fails_cleanly(
        capsys,
        sample,
        good_target,
        big,
        "larger than the side-file limit of 2,000 bytes: pass --max-side-file-size",
        "--max-side-file-size",
        "2KB",
    )

    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        sample.role_dir,
        "--target_dir",
        tmp_path / "raised",
        "--max-side-file-size",
        f"{size}",
        "--no-progress",
    )
    assert code == 0, err
    assert (tmp_path / "raised" / "tokenizer.json").read_bytes() == big.read_bytes()


def test_default_size_cap_fits_a_real_tokenizer(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    tokenizer = sample.role_dir / "huggingface" / "tokenizer.json"
    with open(tokenizer, "ab") as f:  # as big as the largest real tokenizer.json files (~33 MB)
        f.truncate(33_000_000)

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--no-progress"
    )

    assert code == 0, err
    assert (tmp_path / "out" / "tokenizer.json").stat().st_size == 33_000_000


def test_bad_size_cap_is_one_line(capsys, tmp_path, fsdp_checkpoint):
    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        fsdp_checkpoint(SPEC).role_dir,
        "--target_dir",
        tmp_path / "out",
        "--max-side-file-size",
        "lots",
    )
    assert code == 1 and error_lines(err) == ["error: --max-side-file-size 'lots': expected a size such as 64MB or 1GB"]
    assert not (tmp_path / "out").exists()


def test_a_symlink_swapped_while_copying_never_leaks(tmp_path, fsdp_checkpoint, fresh_copy):
    """Another process flips chat_template.jinja between a file inside the checkpoint and a secret outside,
    as fast as it can, while side files are copied again and again: the file is checked where it was
    opened, so each copy is the inside file or refused, never the secret."""
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    hf_dir = sample.role_dir / "huggingface"
    link, secret = hf_dir / "chat_template.jinja", secret_outside(tmp_path)
    inside = link.rename(sample.role_dir / "template_inside.jinja")
    flipper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\nlink, new, a, b = sys.argv[1:]\nwhile True:\n for to in (a, b):\n"
            "  os.symlink(to, new); os.replace(new, link)",
            str(link),
            str(sample.role_dir / "link.new"),
            str(inside),
            str(secret),
        ]
    )
    copies = refused = 0
    try:
        while not link.is_symlink():
            time.sleep(0.001)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            out = tmp_path / f"out_{copies}"
            out.mkdir()
            try:
                copy_side_files(hf_dir, out, confine_to=sample.role_dir)
            except MergeError as exc:
                assert "outside the checkpoint folder" in str(exc) or "file not found" in str(exc), exc
                refused += 1
            else:
                assert (out / "chat_template.jinja").read_bytes() == inside.read_bytes()
            shutil.rmtree(out)
            copies += 1
    finally:
        flipper.kill()
        flipper.wait()
    assert copies > 50 and refused > 0, (copies, refused)  # the race was run, many times, both ways


def test_model_data_beside_the_weights_is_copied_but_no_weight_file(tmp_path):
    """Qwen2.5-Omni's speakers (spk_dict.pt: its from_pretrained refuses a folder without them) are copied like the
    tokenizer; any other .pt file there is a weight file the merged weights replace."""
    hf_dir, out = tmp_path / "huggingface", tmp_path / "out"
    hf_dir.mkdir()
    out.mkdir()
    for name, data in (("spk_dict.pt", b"speakers"), ("pytorch_model.pt", b"weights"), ("tokenizer.json", b"{}")):
        (hf_dir / name).write_bytes(data)

    copied = copy_side_files(hf_dir, out, confine_to=tmp_path)

    assert sorted(copied) == ["spk_dict.pt", "tokenizer.json"]
    assert (out / "spk_dict.pt").read_bytes() == b"speakers"
    assert not (out / "pytorch_model.pt").exists()
