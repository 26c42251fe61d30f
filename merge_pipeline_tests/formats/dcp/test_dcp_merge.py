"""Plain DCP folders written by FSDP2 on gloo as torchtitan, accelerate, NeMo-RL and NeMo-Automodel
save them merge bit for bit (torchtitan's q/k rows permuted back to HF's rotary layout) into HF folders
that transformers loads and that compute the source model's logits."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import Metadata

from merge_pipeline.formats import open_checkpoint
from merge_pipeline.options import MergeOptions
from merge_pipeline_samples.dcp import SOURCES, torchtitan_name
from merge_pipeline_tests.helpers import (
    DcpSample,
    error_lines,
    load_safetensors_dir,
    merge,
    run_cli,
    same_bits,
    tree_digest,
)

TOKENS = torch.tensor([[1, 5, 17, 1002, 40]])


@pytest.fixture
def fresh_dcp(dcp_sample, tmp_path):
    """``fresh_dcp(source) -> DcpSample`` whose checkpoint folder this test may change."""

    def copy(source: str) -> DcpSample:
        sample = dcp_sample(source)
        folder = tmp_path / "copy" / sample.folder.name
        shutil.copytree(sample.folder, folder)
        return DcpSample(folder, folder / sample.model_dir.relative_to(sample.folder), sample.original_dir)

    return copy


@pytest.mark.parametrize("source", SOURCES)
def test_merge_is_bit_exact_and_computes_the_source_models_logits(capsys, tmp_path, dcp_sample, source):
    sample = dcp_sample(source)
    code, _, err = merge(capsys, sample.folder, tmp_path / "out", "--hf_model_path", sample.original_dir)
    assert code == 0, err

    merged = load_safetensors_dir(tmp_path / "out")
    original = load_file(sample.original_dir / "model.safetensors")
    assert set(merged) == set(original)
    for name, tensor in original.items():
        assert same_bits(merged[name], tensor), name
    # Config and tokenizer come from --hf_model_path: none of these checkpoints holds them.
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (sample.original_dir / "tokenizer.json").read_bytes()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    source_model = transformers.AutoModelForCausalLM.from_pretrained(sample.original_dir).eval()
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS).logits, source_model(TOKENS).logits)


def test_torchtitan_stores_permuted_rows_and_the_plan_streams_them(dcp_sample):
    sample = dcp_sample("torchtitan")
    stored = dcp.FileSystemReader(str(sample.model_dir)).read_metadata().state_dict_metadata
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torchtitan_name(name) in stored and name not in stored
    # Training state and the rotary table beside the model, skipped.
    assert "freqs_cis" in stored and any(key.startswith("optimizer.") for key in stored)
    with open_checkpoint(sample.folder, MergeOptions(hf_model_path=str(sample.original_dir))) as plan:
        assert plan.backend == "dcp" and plan.layout["dcp_source"] == "torchtitan"
        q_proj = next(t for t in plan.tensors if t.name == name)
        # Not a byte copy of the stored tensor: its chunks read in their order, each head's rows permuted
        # in memory (one file range per row made the plan grow with rows x chunks).
        assert q_proj.source.byte_runs() is None
        assert len(q_proj.source.stored.byte_runs()) == len(stored[torchtitan_name(name)].chunks)
        original = load_file(sample.original_dir / "model.safetensors")[name]
        assert torch.equal(q_proj.load().view(q_proj.shape), original)


@pytest.mark.parametrize("source", SOURCES)
def test_inspect_describes_the_source(capsys, dcp_sample, source):
    sample = dcp_sample(source)
    code, out, err = run_cli(capsys, "inspect", sample.folder, "--hf_model_path", sample.original_dir, "--json")
    assert code == 0, err
    facts = json.loads(out)
    expected = {
        "torchtitan": "torchtitan",
        "accelerate": "accelerate FSDP SHARDED_STATE_DICT",
        "nemo_rl": "NeMo-RL",
        "nemo_automodel": "NeMo-Automodel",
        "nemo_automodel_safetensors": "DCP in Hugging Face storage (HuggingFaceStorageWriter, not consolidated)",
    }[source]
    assert facts["backend"] == "dcp" and facts["dcp_source"] == expected
    assert facts["architecture"] == "LlamaForCausalLM" and facts["stored_tensors"] == 21


def test_torchtitan_without_hf_model_path_says_so_in_one_line(capsys, tmp_path, dcp_sample):
    sample = dcp_sample("torchtitan")
    code, _, err = merge(capsys, sample.folder, tmp_path / "out")
    assert code == 1
    [line] = error_lines(err)
    assert str(sample.folder) in line and "pass --hf_model_path" in line, line
    assert not (tmp_path / "out").exists()


def _missing_distcp(sample: DcpSample) -> tuple[Path, str]:
    victim = sample.model_dir / "__1_0.distcp"
    victim.unlink()
    return victim, "missing: .metadata stores chunks of"


def _chunk_outside_its_folder(sample: DcpSample) -> tuple[Path, str]:
    metadata_path = sample.model_dir / ".metadata"
    metadata = dcp.FileSystemReader(str(sample.model_dir)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../__0_0.distcp"
    metadata_path.write_bytes(pickle.dumps(metadata))
    return metadata_path, "lies outside"


def _chunk_past_the_end_of_its_file(sample: DcpSample) -> tuple[Path, str]:
    victim = sample.model_dir / "__0_0.distcp"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim, "(truncated)"


def _build_on_the_metadata_class(sample: DcpSample) -> tuple[Path, str]:
    """A pickle that BUILDs on the class Metadata (a state tuple's second half is set with setattr):
    every later read in the process would see it, were it not put back."""
    metadata_path = sample.model_dir / ".metadata"
    global_ = b"c" + b"torch.distributed.checkpoint.metadata\nMetadata\n"
    state = b"N}" + pickle.dumps("planted", protocol=2)[2:-1] + b"}s\x86"  # (None, {"planted": {}})
    metadata_path.write_bytes(b"\x80\x02" + global_ + state + b"b.")
    return metadata_path, "sets Metadata.planted on the class itself"


HOSTILE = [
    ("accelerate", _missing_distcp),
    ("torchtitan", _chunk_outside_its_folder),
    ("nemo_rl", _chunk_past_the_end_of_its_file),
    ("accelerate", _build_on_the_metadata_class),
]


@pytest.mark.parametrize(("source", "damage"), HOSTILE, ids=[d.__name__.strip("_") for _, d in HOSTILE])
def test_damaged_folder_is_refused_in_one_line_and_a_good_output_is_kept(capsys, tmp_path, fresh_dcp, source, damage):
    sample = fresh_dcp(source)
    target = tmp_path / "out"
    code, _, err = merge(capsys, sample.folder, target, "--hf_model_path", sample.original_dir)
    assert code == 0, err
    good = tree_digest(target)
    path, problem = damage(sample)
    before = tree_digest(sample.folder)

    code, _, err = merge(capsys, sample.folder, target, "--hf_model_path", sample.original_dir, "--overwrite")

    assert code == 1
    [line] = error_lines(err)
    assert str(path) in line and problem in line, line
    assert "Traceback" not in err
    assert tree_digest(sample.folder) == before and tree_digest(target) == good
    assert not hasattr(Metadata, "planted")  # the class is as torch made it


def test_config_and_tokenizer_in_the_checkpoint_need_no_hf_model_path(capsys, tmp_path, fresh_dcp):
    sample = fresh_dcp("accelerate")  # a user who also ran save_pretrained for config and tokenizer
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(sample.original_dir / name, sample.folder / name)
    code, _, err = merge(capsys, sample.folder, tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (sample.folder / "tokenizer.json").read_bytes()
    merged = load_safetensors_dir(tmp_path / "out")
    for name, tensor in load_file(sample.original_dir / "model.safetensors").items():
        assert same_bits(merged[name], tensor), name
