"""Every failure is one clear line: names with newlines or escape codes, pickle refusals, a bad
``--test_hf_dir``, a symlinked ``--target_dir``."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli, tree_digest

SPEC = FsdpSpec(world_size=3, with_optimizer=False)


@pytest.mark.slow
def test_a_newline_or_escape_code_in_a_path_cannot_forge_a_line(tmp_path):
    hostile = tmp_path / "run\nerror: forged line\x1b[31m"
    done = subprocess.run(
        [sys.executable, "-m", "merge_pipeline", "merge", "--local_dir", hostile, "--target_dir", tmp_path / "out"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "\x1b" not in done.stderr, repr(done.stderr)
    assert done.stderr == f"error: {tmp_path}/run\\nerror: forged line\\x1b[31m: does not exist\n"


@pytest.mark.parametrize(
    "payload, refused",
    [(uuid.UUID(int=1), "uuid.UUID"), (os.system, "posix.system")],
    ids=["unlisted global", "blocked module"],
)
def test_pickle_refusal_names_the_global_without_colour_codes(
    capsys, tmp_path, fsdp_checkpoint, fresh_copy, payload, refused
):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    rank_file = sample.role_dir / "model_world_size_3_rank_1.pt"
    state = torch.load(rank_file, weights_only=True)
    state["payload"] = payload
    torch.save(state, rank_file)

    code, _, err = run_cli(capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out")

    assert code == 1 and "\x1b" not in err and "\\x1b" not in err
    assert error_lines(err) == [
        f"error: {rank_file}: refused to unpickle (weights_only=True): the file names the global {refused}, which is not allowed"
    ]


def _not_a_folder(tmp_path):
    (tmp_path / "ref").write_text("not a folder")
    return tmp_path / "ref", "reference folder is not a directory"


def _empty_folder(tmp_path):
    (tmp_path / "ref").mkdir()
    return tmp_path / "ref", "no model.safetensors or model.safetensors.index.json"


def _garbage_safetensors(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "model.safetensors").write_bytes(b"\xff" * 64)
    return tmp_path / "ref" / "model.safetensors", "not a readable safetensors file"


def _garbage_index(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "model.safetensors.index.json").write_text('{"weight_map": ["a", "b"]}')
    return tmp_path / "ref" / "model.safetensors.index.json", "not a safetensors index"


def _index_names_a_missing_file(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "model.safetensors.index.json").write_text(
        '{"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}'
    )
    return tmp_path / "ref" / "model-00001-of-00002.safetensors", "file not found"


def _missing(tmp_path):
    return tmp_path / "ref", "reference folder does not exist"


BAD_REFERENCES = [
    _missing,
    _not_a_folder,
    _empty_folder,
    _garbage_safetensors,
    _garbage_index,
    _index_names_a_missing_file,
]


@pytest.mark.parametrize("make", BAD_REFERENCES, ids=[m.__name__.strip("_") for m in BAD_REFERENCES])
def test_bad_test_hf_dir_is_one_line(capsys, tmp_path, fsdp_checkpoint, make):
    bad, problem = make(tmp_path)

    code, _, err = run_cli(
        capsys, "test", "--local_dir", fsdp_checkpoint(SPEC).role_dir, "--test_hf_dir", tmp_path / "ref"
    )

    assert code == 1 and "Traceback" not in err
    [line] = error_lines(err)
    assert line.startswith(f"error: {bad}: {problem}"), line


@pytest.mark.parametrize("dangling", [False, True], ids=["to a folder", "dangling"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
def test_symlinked_target_is_refused_and_left_alone(capsys, tmp_path, fsdp_checkpoint, dangling, overwrite):
    real = tmp_path / "real_folder"
    if not dangling:
        real.mkdir()
        (real / "notes.txt").write_text("the user's own file")
    before = tree_digest(real)
    link = tmp_path / "out"
    link.symlink_to(real)

    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        fsdp_checkpoint(SPEC).role_dir,
        "--target_dir",
        link,
        *(["--overwrite"] if overwrite else []),
    )

    assert code == 1 and "Traceback" not in err
    assert error_lines(err) == [f"error: {link}: is a symlink (to {real}): give the real folder as --target_dir"]
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.exists() != dangling and tree_digest(real) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *([] if dangling else ["real_folder"])]), (
        "no staging or lock left"
    )
