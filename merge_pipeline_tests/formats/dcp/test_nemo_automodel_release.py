"""Checkpoints written by NeMo-Automodel 0.7.0 itself -- a transformers Llama, ``fully_shard`` on two
gloo ranks, its own ``Checkpointer.save_model`` and ``save_optimizer`` -- merge from the CLI with
``--backend auto`` bit for bit into the model's own state dict and into the consolidated HF folder
NeMo-Automodel exports itself: its sharded safetensors (DCP in HF storage, the config in
``model/.hf_metadata/``) with no other option, its ``torch_save`` DCP with ``--hf_model_path``, and
NeMo-RL 0.6's policy folder, which NeMo-RL saves through the same calls.

NeMo-Automodel runs in its own venv (``scripts/setup_nemo.sh``, called by ``scripts/test.sh``);
the writer is ``merge_pipeline_samples/nemo_automodel_save.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from merge_pipeline_tests.helpers import assert_bit_exact, error_lines, run_cli, write_with_release

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def automodel_saves(tmp_path_factory) -> Path:
    """``<root>/{safetensors,torch_save}/epoch_0_step_1/{model,optim}``, ``expected/model.safetensors``, ``hf/``."""
    return write_with_release(
        ".venv-nemo", "nemo_automodel_save.py", tmp_path_factory.mktemp("nemo_automodel"), timeout=600
    )


def test_sharded_safetensors_merge_bit_for_bit_with_no_option(capsys, tmp_path, automodel_saves):
    """The step folder as its recipes leave it: per-rank ``shard-*`` files, ``.hf_metadata/``,
    ``consolidated/``, ``optim/``; the merge equals the model's weights and its own consolidation."""
    step = automodel_saves / "safetensors" / "epoch_0_step_1"
    assert sorted(p.name for p in (step / "model").glob("shard-*.safetensors")) == [
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out", "--backend", "auto", "--no-progress"
    )
    assert code == 0, err
    assert_bit_exact(tmp_path / "out", automodel_saves / "expected")
    assert_bit_exact(tmp_path / "out", step / "model" / "consolidated")
    assert not (tmp_path / "out" / "fqn_to_file_index_mapping.json").exists()  # its shard plan, not the model's
    _, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_torch_save_dcp_merges_bit_for_bit_with_hf_model_path(capsys, tmp_path, automodel_saves):
    step = automodel_saves / "torch_save" / "epoch_0_step_1"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out", "--backend", "auto",
        "--hf_model_path", automodel_saves / "hf", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert_bit_exact(tmp_path / "out", automodel_saves / "expected")


def test_torch_save_dcp_without_hf_model_path_says_what_to_pass(capsys, tmp_path, automodel_saves):
    """NeMo-Automodel's ``torch_save`` format saves no config."""
    step = automodel_saves / "torch_save" / "epoch_0_step_1"
    code, _, err = run_cli(capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out")
    assert code == 1
    [line] = error_lines(err)
    assert "config.json" in line and "--hf_model_path" in line, line
    assert not (tmp_path / "out").exists()


def test_nemo_rl_policy_folder_merges_bit_for_bit_with_no_option(capsys, tmp_path, automodel_saves):
    """NeMo-RL 0.6's DTensor v2 policy saves through NeMo-Automodel (``policy/weights/model/``,
    ``policy/optimizer/optim/``). NeMo-RL is not installable (``nemo-rl`` 0.0.0 on the registry is an
    empty placeholder): the writer makes its AutomodelCheckpointManager's calls as NeMo-RL's source at
    commit 7ea279a makes them, on NeMo-Automodel 0.7.0 itself."""
    policy = automodel_saves / "nemo_rl" / "step_1" / "policy"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", policy, "--target_dir", tmp_path / "out", "--backend", "auto", "--no-progress"
    )
    assert code == 0, err
    assert_bit_exact(tmp_path / "out", automodel_saves / "expected")
