"""``lora_train_meta.json`` is checked against the LoRA tensors, and its alpha is kept exactly."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, merge, same_bits, tree_digest

SPEC = FsdpSpec(lora=(4, 8))  # r=4 on q/k/v/o; hidden 64, k_proj has 32 output rows
META = "lora_train_meta.json"


def write_meta(role_dir, **changes):
    meta = json.loads((role_dir / META).read_text())
    meta.update(changes)
    (role_dir / META).write_text(json.dumps(meta))


def test_float_alpha_is_kept_exactly(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    import peft

    sample = fresh_copy(fsdp_checkpoint(SPEC))
    write_meta(sample.role_dir, lora_alpha=16.5)
    code, _, err = merge(capsys, sample.role_dir, tmp_path / "adapter")
    assert code == 0, err
    assert json.loads((tmp_path / "adapter" / "lora_adapter" / "adapter_config.json").read_text())["lora_alpha"] == 16.5
    assert json.loads((tmp_path / "adapter" / MANIFEST).read_text())["decisions"]["lora"]["lora_alpha"] == 16.5

    code, _, err = merge(capsys, sample.role_dir, tmp_path / "merged", "--merge-lora")
    assert code == 0, err
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")
    expected = (
        peft.PeftModel.from_pretrained(base, tmp_path / "adapter" / "lora_adapter").merge_and_unload().state_dict()
    )
    merged = load_safetensors_dir(tmp_path / "merged")
    assert set(merged) == set(expected)
    for name, tensor in merged.items():
        assert same_bits(tensor, expected[name]), name


BAD_META = {
    "r_zero": ({"r": 0}, "'r' must be a positive integer, found 0"),
    "r_string": ({"r": "4"}, "'r' must be a positive integer, found '4'"),
    "r_bool": ({"r": True}, "'r' must be a positive integer, found True"),
    "r_missing": ({"r": None}, "'r' must be a positive integer, found None"),
    "alpha_string": ({"lora_alpha": "eight"}, "'lora_alpha' must be a finite number, found 'eight'"),
    "alpha_nan": ({"lora_alpha": float("nan")}, "'lora_alpha' must be a finite number, found nan"),
    "r_disagrees_with_tensors": (
        {"r": 8},
        "says r=8 but base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight is (4, 64)",
    ),
}


@pytest.mark.parametrize("change", BAD_META, ids=list(BAD_META))
def test_meta_that_does_not_fit_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy, change):
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    changes, problem = BAD_META[change]
    write_meta(sample.role_dir, **changes)
    before = tree_digest(sample.role_dir)
    for flags in ((), ("--merge-lora",)):
        code, _, err = merge(capsys, sample.role_dir, tmp_path / "out", *flags)
        assert code == 1 and "Traceback" not in err
        [line] = error_lines(err)
        assert f"{sample.role_dir / META}: {problem}" in line, line
    assert tree_digest(sample.role_dir) == before and not (tmp_path / "out").exists()


def test_lora_b_that_does_not_fit_the_base_weight_is_refused(capsys, tmp_path, fsdp_checkpoint, fresh_copy):
    """q_proj's lora_B swapped with k_proj's in every rank file: B is 32 x r for a 64 x 64 weight."""
    sample = fresh_copy(fsdp_checkpoint(SPEC))
    q, k = (f"base_model.model.model.layers.0.self_attn.{p}.lora_B.default.weight" for p in ("q_proj", "k_proj"))
    for path in sample.role_dir.glob("model_world_size_*_rank_*.pt"):
        state = torch.load(path, weights_only=True)
        state[q], state[k] = state[k], state[q]
        torch.save(state, path)
    code, _, err = merge(capsys, sample.role_dir, tmp_path / "out")
    assert code == 1
    [line] = error_lines(err)
    assert (
        f"{sample.role_dir}: LoRA module base_model.model.model.layers.0.self_attn.q_proj: lora_B (32, 4) @ lora_A (4, 64) does not fit the base weight (64, 64)"
        in line
    ), line
