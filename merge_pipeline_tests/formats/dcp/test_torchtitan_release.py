"""Checkpoints written by torchtitan 0.3.0 itself -- its own models (llama3, qwen3 dense and MoE,
deepseek_v3, qwen3_5 dense and MoE, kimi_k2_7, gpt_oss), ``fully_shard`` on two gloo ranks, its
``CheckpointManager.save`` -- merge from the CLI with ``--backend auto`` bit for bit into what each family's
own ``state_dict_adapter.to_hf`` gives, and (llama3, qwen3, qwen3_moe, deepseek_v3, qwen3_5_moe, gpt_oss) transformers'
logits equal torchtitan's own forward; so does the last step, which torchtitan saves as HF safetensors
(``last_save_in_hf``), and its per-rank ``sharded/`` files alone. qwen3_5's model imports
flash-linear-attention's GPU kernels, which saving never runs: the writer stands empty modules in
for that import. qwen3_5_moe's ``to_hf`` transposes its grouped experts into a fused layout transformers 5
does not load: they are merged per expert, as transformers loads them, and compared with ``to_hf``'s
tensors transposed back (torchtitan 0.3.0 cannot save that family with ``last_save_in_hf``). kimi_k2_7 (Kimi-K2.5) is checked by the names transformers 5 loads, not the ones it
would save (``hf/load_names.py``). gpt_oss's ``to_hf`` drops its grouped experts (its map names
``mlp1_weight``, the model saves ``mlp1_weight_EGD``): the merge writes them as transformers'
GptOssForCausalLM loads them, checked bit for bit against torchtitan's own tensors and by the logits;
its ``last_save_in_hf`` step, without them, is refused in one line.

torchtitan runs in its own venv (``scripts/setup_torchtitan.sh``, called by ``scripts/test.sh``);
the writer is ``merge_pipeline_samples/torchtitan_save.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from merge_pipeline.formats import open_checkpoint
from merge_pipeline.options import MergeOptions
from merge_pipeline_tests.helpers import (
    assert_bit_exact,
    error_lines,
    load_safetensors_dir,
    run_cli,
    same_bits,
    write_with_release,
)

pytestmark = pytest.mark.slow

FAMILIES = (
    "llama3",
    "qwen3",
    "qwen3_moe",
    "deepseek_v3",
    "qwen3_5",
    "qwen3_5_moe",
    "kimi_k2_7",
    "gpt_oss",
)  # merged from the CLI
# torchtitan 0.3.0's last_save_in_hf fails on qwen3_5_moe (its to_hf's transposed experts are not contiguous)
# and leaves gpt_oss's experts out (its to_hf drops them).
SAVED_IN_HF = tuple(family for family in FAMILIES if family not in ("qwen3_5_moe", "gpt_oss"))


@pytest.fixture(scope="module")
def torchtitan_saves(tmp_path_factory) -> Path:
    """``<root>/<family>/{checkpoint/step-1, checkpoint/step-2 (HF), expected/model.safetensors, hf/config.json}``,
    and ``expected/logits.safetensors`` (torchtitan's forward) for the families in ``LOGITS_ATOL``."""
    return write_with_release(
        ".venv-torchtitan", "torchtitan_save.py", tmp_path_factory.mktemp("torchtitan"), "--family", *FAMILIES
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_equals_the_families_own_to_hf_bit_for_bit(capsys, tmp_path, torchtitan_saves, family):
    saved = torchtitan_saves / family
    step = saved / "checkpoint" / "step-1"
    hf = saved / "hf"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out", "--backend", "auto",
        "--hf_model_path", hf, "--no-progress",
    )  # fmt: skip
    assert code == 0, err

    merged = load_safetensors_dir(tmp_path / "out")
    expected = load_file(saved / "expected" / "model.safetensors")
    if family == "gpt_oss":
        expected.update(_gpt_oss_experts_as_hf_loads_them(saved))
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        assert same_bits(merged[name], tensor), name
    plan = open_checkpoint(step, MergeOptions(hf_model_path=str(hf)))
    with plan:
        assert plan.backend == "dcp" and plan.layout["dcp_source"] == "torchtitan"
    # The folder is a model transformers builds with nothing missing or left over.
    architecture = json.loads((hf / "config.json").read_text())["architectures"][0]
    model_class = getattr(transformers, architecture)
    _, info = model_class.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def _gpt_oss_experts_as_hf_loads_them(saved: Path) -> dict[str, torch.Tensor]:
    """torchtitan's grouped experts ([E, out, in], gate and up interleaved on the rows, as its swiglu
    reads them) as GptOssForCausalLM holds them: each expert's matrix transposed, the biases as they are."""
    experts = load_file(saved / "expected" / "grouped_experts.safetensors")
    out = {}
    for layer in range(2):
        tt, hf = f"layers.{layer}.moe.routed_experts.inner_experts.", f"model.layers.{layer}.mlp.experts."
        out[hf + "gate_up_proj"] = experts[tt + "mlp1_weight_EGD"].transpose(1, 2)
        out[hf + "gate_up_proj_bias"] = experts[tt + "mlp1_bias_EG"]
        out[hf + "down_proj"] = experts[tt + "mlp2_weight_EDF"].transpose(1, 2)
        out[hf + "down_proj_bias"] = experts[tt + "mlp2_bias_ED"]
    assert len(out) == len(experts)
    return out


# fp32 op order (fused vs split q/k/v, rotary form) moves logits of order 1 by ~1e-6; torchtitan 0.3.0's
# MoE experts always multiply in bf16 (GroupedExperts casts to bfloat16), so the MoE families by ~5e-4
# (deepseek_v3: 1.5e-4; routed otherwise -- no group limit, no expert bias, no normalization or no scaling --
# it moves by 1.3e-2 or more), and gpt_oss (whose experts also add their biases and take the clamped swiglu
# in bf16) by 5.5e-3 on logits up to 4.5. Measured on the same gpt_oss folder: gate/up columns not
# interleaved 1.07, two experts' down_proj swapped 0.66.
LOGITS_ATOL = {
    "llama3": 1e-5,
    "qwen3": 1e-5,
    "qwen3_moe": 2e-3,
    "deepseek_v3": 2e-3,
    "qwen3_5_moe": 2e-3,
    "gpt_oss": 1e-2,
}


@pytest.mark.parametrize("family", LOGITS_ATOL)
def test_merged_logits_equal_torchtitans_own_forward(capsys, tmp_path, torchtitan_saves, family):
    """transformers' forward of the merged folder equals torchtitan's own forward of the saved weights.
    deepseek_v3's debug flavor routes by softmax, transformers' DeepseekV3 only as DeepSeek-V3 does: the writer
    builds it with that routing (sigmoid, a nonzero expert bias, two expert groups, normalized and scaled
    weights). Linear attention's forward needs flash-linear-attention's GPU kernels: qwen3_5 is left out, and
    qwen3_5_moe is built with full-attention layers only (its experts are what this compares)."""
    saved = torchtitan_saves / family
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", saved / "checkpoint" / "step-1", "--target_dir", tmp_path / "out",
        "--backend", "auto", "--hf_model_path", saved / "hf", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    expected = load_file(saved / "expected" / "logits.safetensors")
    architecture = json.loads((saved / "hf" / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, architecture).from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=LOGITS_ATOL[family], rtol=0)


def test_kimi_k2_7_is_checked_by_the_names_transformers_loads(capsys, tmp_path, torchtitan_saves):
    """Kimi-K2.5: DeepSeek-V3's names under ``language_model.`` beside the vision tower's, whose q/k/v
    are concatenated and whose patch embedding is reshaped into a Conv2d weight (merged bit-exact above).
    transformers 5 would save its language layers as ``language_model.model.blocks.N`` (its reverse
    renaming undoes ``blocks`` -> ``layers`` everywhere) but loads the Hub's ``layers.N``: that name
    passes, and a name loading puts nowhere is still refused."""
    saved = torchtitan_saves / "kimi_k2_7"
    expected = load_file(saved / "expected" / "model.safetensors")
    assert expected["vision_tower.patch_embed.proj.weight"].dim() == 4 and any(".wqkv." in k for k in expected)
    assert "language_model.model.layers.0.self_attn.o_proj.weight" in expected
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in expected
    folder = tmp_path / "renamed"
    shutil.copytree(saved / "checkpoint" / "step-2", folder)  # its HF files renamed below, sharded/ not read
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    wrong = {
        "language_model.model.layers.0.self_attn.o_proj.weight": "language_model.model.layers.0.self_attn.out_proj.weight"
    }
    index["weight_map"] = {wrong.get(k, k): v for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    [shard] = folder.glob("model-*.safetensors")
    tensors = load_file(shard)
    save_file({wrong.get(k, k): t for k, t in tensors.items()}, shard)
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", folder, "--target_dir", tmp_path / "out", "--hf_model_path", saved / "hf"
    )
    assert code == 1
    [line] = error_lines(err)
    assert "1 unexpected" in line and "self_attn.out_proj.weight" in line, line
    assert "1 missing: language_model.model." in line and "0.self_attn.o_proj.weight" in line, line
    assert not (tmp_path / "out").exists()


def test_gpt_oss_last_save_in_hf_without_its_experts_is_one_line(capsys, tmp_path, torchtitan_saves):
    """torchtitan 0.3.0 saves gpt_oss's ``last_save_in_hf`` step through its ``to_hf``, which drops
    every expert tensor: that folder is refused, naming what is missing; its DCP steps merge whole."""
    saved = torchtitan_saves / "gpt_oss"
    assert not any(".experts." in name for name in load_file(saved / "expected" / "model.safetensors"))
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", saved / "checkpoint" / "step-2", "--target_dir", tmp_path / "out",
        "--hf_model_path", saved / "hf",
    )  # fmt: skip
    assert code == 1
    [line] = error_lines(err)
    assert "8 missing: model.layers.0.mlp.experts.down_proj" in line, line
    assert not (tmp_path / "out").exists()


def test_a_family_without_a_torchtitan_mapping_is_one_line_naming_model_type(capsys, tmp_path, torchtitan_saves):
    config = json.loads((torchtitan_saves / "llama3" / "hf" / "config.json").read_text())
    shutil.copytree(torchtitan_saves / "llama3" / "hf", tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    step = torchtitan_saves / "llama3" / "checkpoint" / "step-1"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out", "--hf_model_path", tmp_path / "hf"
    )
    assert code == 1
    [line] = error_lines(err)
    assert "model_type 'mixtral'" in line and "--hf_model_path" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", SAVED_IN_HF)
def test_last_save_in_hf_step_folder_is_copied_bit_for_bit(capsys, tmp_path, torchtitan_saves, family):
    """``last_save_in_hf``: torchtitan's HuggingFaceStorageWriter consolidates the last step into
    ``model-*.safetensors`` + index (its ``sharded/`` per-rank files beside them are not read)."""
    saved = torchtitan_saves / family
    step = saved / "checkpoint" / "step-2"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out", "--hf_model_path", saved / "hf",
        "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")
    expected = load_file(saved / "expected" / "model.safetensors")
    assert set(merged) == set(expected)
    assert all(same_bits(merged[name], tensor) for name, tensor in expected.items())


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_last_save_in_hf_sharded_alone_merges_as_its_consolidation(capsys, tmp_path, torchtitan_saves, family):
    """A step folder whose consolidation did not run (only ``sharded/``, each rank's DTensor pieces in
    HF storage): merged from the pieces' offsets, bit for bit what torchtitan's own consolidation wrote."""
    saved = torchtitan_saves / family
    step = tmp_path / "checkpoint" / "step-2"
    shutil.copytree(saved / "checkpoint" / "step-2" / "sharded", step / "sharded")
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out", "--backend", "auto",
        "--hf_model_path", saved / "hf", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert_bit_exact(tmp_path / "out", saved / "checkpoint" / "step-2")  # its consolidated model-*.safetensors


def test_last_save_in_hf_without_hf_model_path_says_what_to_pass(capsys, tmp_path, torchtitan_saves):
    step = torchtitan_saves / "llama3" / "checkpoint" / "step-2"
    code, _, err = run_cli(capsys, "merge", "--local_dir", step, "--target_dir", tmp_path / "out")
    assert code == 1
    [line] = error_lines(err)
    assert "config.json" in line and "--hf_model_path" in line, line
    assert not (tmp_path / "out").exists()
