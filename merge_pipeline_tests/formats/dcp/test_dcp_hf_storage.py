"""DCP saved in Hugging Face storage without consolidation (torch's ``HuggingFaceStorageWriter`` with
``save_distributed=True``, as NeMo-Automodel's sharded safetensors save and torchtitan's ``sharded/``):
FSDP2 on two gloo ranks writes the real files, the CLI merges them bit for bit into one HF folder.
(The merge and the logits are also checked with every DCP source in ``test_dcp_merge.py``.)"""

from __future__ import annotations

import json
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from merge_pipeline.formats import open_checkpoint
from merge_pipeline.options import MergeOptions
from merge_pipeline_tests.helpers import assert_bit_exact, error_lines, merge, tree_digest

SOURCE = "nemo_automodel_safetensors"
EMBEDDING = "model.embed_tokens.weight"  # 1003 rows: 502 on rank 0, 501 on rank 1


def test_the_writer_leaves_per_rank_pieces_with_their_offsets_and_no_metadata(dcp_sample):
    sample = dcp_sample(SOURCE)
    names = sorted(p.name for p in sample.model_dir.iterdir())
    assert names == [f"shard-0000{r}-model-0000{k}-of-00002.safetensors" for r in (1, 2) for k in (1, 2)]
    rows = {}
    for path in sorted(sample.model_dir.glob("shard-*-model-00001-*")):
        with safe_open(path, "pt") as f:
            info = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            rows[info[EMBEDDING]["saved_offsets"][0]] = f.get_slice(EMBEDDING).get_shape()[0]
    assert rows == {0: 502, 502: 501}
    with open_checkpoint(sample.folder, MergeOptions(hf_model_path=str(sample.original_dir))) as plan:
        assert plan.backend == "dcp" and plan.layout["dcp_folder"] == "model"
        assert plan.layout["files"] == 4 and plan.layout["chunks"] == 2 * plan.layout["stored_tensors"]


def test_torchtitans_sharded_folder_merges_bit_for_bit_when_its_consolidation_did_not_run(capsys, tmp_path, dcp_sample):
    """torchtitan's ``last_save_in_hf`` writes ``step-N/sharded/`` first, then consolidates beside it."""
    sample = dcp_sample(SOURCE)
    step = tmp_path / "checkpoint" / "step-3"
    shutil.copytree(sample.model_dir, step / "sharded")
    code, _, err = merge(capsys, step, tmp_path / "out", "--backend", "auto", "--hf_model_path", sample.original_dir)
    assert code == 0, err
    assert_bit_exact(tmp_path / "out", sample.original_dir)


def test_a_piece_placed_outside_its_tensor_is_refused_in_one_line(capsys, tmp_path, dcp_sample):
    sample = dcp_sample(SOURCE)
    folder = tmp_path / "copy"
    shutil.copytree(sample.folder, folder)
    target = tmp_path / "out"
    code, _, err = merge(capsys, folder, target, "--hf_model_path", sample.original_dir)
    assert code == 0, err
    good = tree_digest(target)
    victim = next((folder / "model").glob("shard-00002-model-00001-*"))
    with safe_open(victim, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(victim)
    info = json.loads(metadata["DCP_SHARDING_INFO"])
    info[EMBEDDING]["saved_offsets"] = [5000, 0]  # rank 1's rows past the end of the 1003-row embedding
    save_file(tensors, victim, metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(info)})
    before = tree_digest(folder)

    code, _, err = merge(capsys, folder, target, "--hf_model_path", sample.original_dir, "--overwrite")

    assert code == 1
    [line] = error_lines(err)
    assert str(folder / "model") in line and EMBEDDING in line and "do not cover" in line, line
    assert tree_digest(folder) == before and tree_digest(target) == good
    assert torch.equal(load_file(victim)[EMBEDDING], tensors[EMBEDDING])  # the input untouched
