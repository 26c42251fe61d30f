"""The reader registry: a format is one module of ``merge_pipeline.formats`` exposing ``READER``."""

from __future__ import annotations

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.formats import BACKENDS, READERS, detect_backend, reader
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.conftest import copy_checkpoint
from merge_pipeline_tests.helpers import error_lines, run_cli


@pytest.mark.parametrize("name", READERS)
def test_each_reader_module_exposes_one_reader_named_as_its_backend(name):
    found = reader(name)
    assert (found.name, callable(found.detect), callable(found.plan), bool(found.looks_for)) == (name, True, True, True)


def test_backends_are_auto_and_the_registered_readers():
    assert BACKENDS == ("auto", *READERS)


def test_an_unknown_backend_is_one_line_listing_the_known_ones():
    assert {"auto", "fsdp", "megatron", "hf", "deepspeed", "dcp"} <= set(BACKENDS)  # users type these
    with pytest.raises(MergeError, match=rf"^--backend must be one of {', '.join(BACKENDS)}, not 'zip'$"):
        reader("zip")


def test_auto_detection_asks_the_readers_in_order(fsdp_checkpoint, tmp_path):
    assert detect_backend(fsdp_checkpoint(FsdpSpec()).role_dir) == "fsdp"
    with pytest.raises(MergeError) as error:
        detect_backend(tmp_path)
    assert all(reader(name).looks_for in str(error.value) for name in READERS)


def test_the_common_wrong_folders_say_what_they_are_and_what_to_pass(fsdp_checkpoint, tmp_path, capsys):
    sample = fsdp_checkpoint(FsdpSpec())
    step = tmp_path / "run" / "global_step_1"
    for role in ("actor", "critic"):
        copy_checkpoint(sample, step / role)
    copy_checkpoint(sample, tmp_path / "run" / "global_step_10" / "actor")
    (tmp_path / "run" / "global_step_9").mkdir()
    for name in ("step-2", "step-10"):  # torchtitan's step folders hold the save itself
        (tmp_path / "titan_run" / name).mkdir(parents=True)
    merged = tmp_path / "merged"
    assert run_cli(capsys, "merge", "--local_dir", str(sample.role_dir), "--target_dir", str(merged))[0] == 0
    expected = {
        step: f"holds role folders actor, critic: pass {step / 'actor'}",
        tmp_path
        / "run": f"a run folder: the newest step is global_step_10: pass {tmp_path / 'run/global_step_10/actor'}",
        tmp_path / "titan_run": f"a run folder: the newest step is step-10: pass {tmp_path / 'titan_run/step-10'}",
        merged: "is already a merged Hugging Face folder (config.json, *.safetensors): nothing to merge",
    }
    for folder, problem in expected.items():
        code, _, err = run_cli(capsys, "merge", "--local_dir", str(folder), "--target_dir", str(tmp_path / "out"))
        assert (code, error_lines(err)) == (1, [f"error: {folder}: {problem}"])
    assert not (tmp_path / "out").exists()
