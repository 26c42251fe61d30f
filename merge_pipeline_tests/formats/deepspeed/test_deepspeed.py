"""DeepSpeed ZeRO 1/2/3 checkpoints, trained and saved by DeepSpeed on CPU, merge bit for bit.

The peer is DeepSpeed's own ``zero_to_fp32`` (``get_fp32_state_dict_from_zero_checkpoint``), run on
the same folder; the trained model is what DeepSpeed itself gathered at the end of training.
"""

from __future__ import annotations

import json
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from merge_pipeline_samples.deepspeed import TRAINED_WEIGHTS
from merge_pipeline_tests.helpers import (
    VARIANTS,
    assert_loads_every_stored_value,
    error_lines,
    load_safetensors_dir,
    merge,
    run_cli,
    same_bits,
    tree_digest,
)


@pytest.fixture(scope="session")
def zero_to_fp32(deepspeed_checkpoints):
    """What DeepSpeed's own converter makes of each checkpoint (weights only)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {
        name: get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
        for name, (save_dir, _) in deepspeed_checkpoints.items()
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_is_bit_exact_against_zero_to_fp32_and_the_trained_model(
    capsys, tmp_path, deepspeed_checkpoints, zero_to_fp32, variant
):
    save_dir, reference_dir = deepspeed_checkpoints[variant]
    code, _, err = merge(capsys, save_dir, tmp_path / "out", "--hf_model_path", reference_dir)
    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")
    # zero_to_fp32 keeps the names of the module DeepSpeed wrapped: OpenRLHF's Actor adds "model.".
    strip = "model." if VARIANTS[variant].openrlhf_actor else ""
    assert all(name.startswith(strip) for name in zero_to_fp32[variant])
    peer = {name.removeprefix(strip): tensor for name, tensor in zero_to_fp32[variant].items()}
    trained = load_file(reference_dir / TRAINED_WEIGHTS)
    spec = VARIANTS[variant]
    assert set(merged) == set(trained) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    # ZeRO 1 records no frozen parameters: zero_to_fp32 drops them, we take them from the module state.
    assert set(peer) == set(trained) - (set(spec.frozen) if spec.stage == 1 else set())
    for name, tensor in merged.items():
        assert name not in peer or same_bits(tensor, peer[name].contiguous()), name
        # bf16 training: the module DeepSpeed gathered holds the fp32 master weights rounded to bf16.
        assert same_bits(tensor.to(trained[name].dtype), trained[name]), name
    for name in spec.frozen:  # as the module stored them: bf16 under bf16 training, as zero_to_fp32
        assert merged[name].dtype == (torch.bfloat16 if spec.bf16 else torch.float32), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] is spec.tie_word_embeddings
    if spec.bf16:  # the bf16 module's frozen parameters beside the fp32 master weights: config.json says float32
        assert {t.dtype for t in merged.values()} == {torch.bfloat16, torch.float32}
    assert_loads_every_stored_value(tmp_path / "out")


def test_merged_folder_loads_and_gives_the_trained_logits(capsys, tmp_path, deepspeed_checkpoints):
    save_dir, reference_dir = deepspeed_checkpoints["zero3-tied-frozen"]
    code, _, err = merge(capsys, save_dir, tmp_path / "out", "--hf_model_path", reference_dir)
    assert code == 0, err
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(reference_dir))
    reference.load_state_dict(load_file(reference_dir / TRAINED_WEIGHTS))
    tokens = torch.tensor([[1, 5, 17, 1002, 40]])
    with torch.no_grad():
        assert torch.equal(merged(tokens).logits, reference.eval()(tokens).logits)
    # The HF Trainer layout: the tokenizer saved beside `latest` is copied; DeepSpeed's own files are not.
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (save_dir / "tokenizer.json").read_bytes()
    assert {"latest", "zero_to_fp32.py"} <= {p.name for p in save_dir.iterdir()}
    assert not {"latest", "zero_to_fp32.py", "zero_to_torch.py"} & {p.name for p in (tmp_path / "out").iterdir()}


def test_bfloat16_output_is_the_fp32_weights_rounded(capsys, tmp_path, deepspeed_checkpoints, zero_to_fp32):
    save_dir, reference_dir = deepspeed_checkpoints["zero2-tied-frozen"]
    code, _, err = merge(capsys, save_dir, tmp_path / "out", "--hf_model_path", reference_dir, "--dtype", "bfloat16")
    assert code == 0, err
    merged = load_safetensors_dir(tmp_path / "out")
    for name, tensor in merged.items():
        assert same_bits(tensor, zero_to_fp32["zero2-tied-frozen"][name].to(torch.bfloat16)), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_tag_folder_and_save_dir_merge_alike(capsys, tmp_path, deepspeed_checkpoints):
    save_dir, reference_dir = deepspeed_checkpoints["zero1"]
    tag = (save_dir / "latest").read_text().strip()
    assert merge(capsys, save_dir, tmp_path / "a", "--hf_model_path", reference_dir)[0] == 0
    assert (
        merge(capsys, save_dir / tag, tmp_path / "b", "--hf_model_path", reference_dir, "--backend", "deepspeed")[0]
        == 0
    )
    assert load_safetensors_dir(tmp_path / "a").keys() == load_safetensors_dir(tmp_path / "b").keys()
    for name, tensor in load_safetensors_dir(tmp_path / "a").items():
        assert same_bits(tensor, load_safetensors_dir(tmp_path / "b")[name]), name


def test_inspect_describes_stage_world_size_and_parameters(capsys, deepspeed_checkpoints, zero_to_fp32):
    save_dir, _ = deepspeed_checkpoints["zero3-tied-frozen"]
    code, out, err = run_cli(capsys, "inspect", save_dir, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert (info["backend"], info["zero_stage"], info["dp_world_size"]) == ("deepspeed", 3, 2)
    assert info["parameters"] == sum(t.numel() for t in zero_to_fp32["zero3-tied-frozen"].values())
    assert info["dtypes"] == {"float32": info["parameters"]}
    assert info["architecture"] == "LlamaForCausalLM" and info["tied_word_embeddings"] is True


def _copy(save_dir: Path, dst: Path) -> tuple[Path, Path]:
    shutil.copytree(save_dir, dst)
    return dst, dst / (dst / "latest").read_text().strip()


def _refused(capsys, save_dir: Path, reference_dir: Path, target: Path, bad_file: Path, problem: str) -> None:
    before = tree_digest(save_dir)
    code, _, err = merge(capsys, save_dir, target, "--hf_model_path", reference_dir)
    assert code != 0
    [line] = error_lines(err)
    assert str(bad_file) in line and problem in line, line
    assert not target.exists()
    assert tree_digest(save_dir) == before


def test_truncated_optimizer_file_is_refused(capsys, tmp_path, deepspeed_checkpoints):
    save_dir, reference_dir = deepspeed_checkpoints["zero3-tied-frozen"]
    copy, tag = _copy(save_dir, tmp_path / "ckpt")
    bad = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size - 5000])
    _refused(capsys, copy, reference_dir, tmp_path / "out", bad, "truncated")


@pytest.mark.parametrize(
    ("foreign_file", "problem"),
    [
        ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "ZeRO stage/partition count differ from rank 0's"),
        ("mp_rank_00_model_states.pt", "but param_shapes lists"),
    ],
)
def test_file_from_another_checkpoint_is_refused(capsys, tmp_path, deepspeed_checkpoints, foreign_file, problem):
    """A ZeRO-2 run's file dropped into a ZeRO-1 run's folder: other stage, other trainable parameters."""
    save_dir, reference_dir = deepspeed_checkpoints["zero1"]
    copy, tag = _copy(save_dir, tmp_path / "ckpt")
    other, _ = deepspeed_checkpoints["zero2-tied-frozen"]
    shutil.copyfile(other / (other / "latest").read_text().strip() / foreign_file, tag / foreign_file)
    named = tag / foreign_file if "optim" in foreign_file else tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _refused(capsys, copy, reference_dir, tmp_path / "out", named, problem)


def test_missing_rank_file_is_refused(capsys, tmp_path, deepspeed_checkpoints):
    save_dir, reference_dir = deepspeed_checkpoints["zero2-tied-frozen"]
    copy, tag = _copy(save_dir, tmp_path / "ckpt")
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _refused(capsys, copy, reference_dir, tmp_path / "out", tag, "partition_count says 2")


def _rewrite_pickle(path: Path, change) -> None:
    """Rewrite the pickle of a real torch.save archive with ``change(bytes) -> bytes``."""
    with zipfile.ZipFile(path) as archive:
        records = {info.filename: archive.read(info) for info in archive.infolist()}
    pickle_name = next(name for name in records if name.endswith("/data.pkl"))
    changed = change(records[pickle_name])
    assert changed != records[pickle_name], "the pattern to change was not found"
    records[pickle_name] = changed
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records.items():
            archive.writestr(name, data)


def test_global_outside_the_allow_list_is_refused(capsys, tmp_path, deepspeed_checkpoints):
    """The real rank-0 optimizer file, its LossScaler global renamed to one DeepSpeed never saves."""
    save_dir, reference_dir = deepspeed_checkpoints["zero1"]
    copy, tag = _copy(save_dir, tmp_path / "ckpt")
    bad = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    scaler = b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n"  # torch.save's protocol 2: GLOBAL opcode
    _rewrite_pickle(bad, lambda data: data.replace(scaler, b"csubprocess\nPopen\n"))
    _refused(capsys, copy, reference_dir, tmp_path / "out", bad, "subprocess.Popen")


def test_unknown_zero_stage_is_refused(capsys, tmp_path, deepspeed_checkpoints):
    """Every rank's ZeroStageEnum(1) rewritten to 4: the pickle is ZeroStageEnum, a memo op, BININT1 1, TUPLE1."""
    save_dir, reference_dir = deepspeed_checkpoints["zero1"]
    copy, tag = _copy(save_dir, tmp_path / "ckpt")
    stage_one = re.compile(rb"(ZeroStageEnum\n(?:q.|r....)K)\x01\x85", re.DOTALL)
    for rank in (0, 1):
        _rewrite_pickle(
            tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            lambda d: stage_one.sub(lambda m: m[1] + b"\x04\x85", d),
        )
    bad = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _refused(capsys, copy, reference_dir, tmp_path / "out", bad, "ZeRO stage 4 is not one this reader knows")


def test_fp16_dynamic_loss_scaler_loads_as_plain_data(tmp_path):
    """fp16 training (not possible on this CPU accelerator) pickles DeepSpeed's DynamicLossScaler:
    the stand-in keeps its state and runs none of its code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from merge_pipeline.formats.deepspeed.reader import ALLOWED_GLOBALS
    from merge_pipeline.formats.torch_files import load_meta_state_dict

    scaler = DynamicLossScaler(
        init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    torch.save({"loss_scaler": scaler}, tmp_path / "optim.pt")
    loaded = load_meta_state_dict(tmp_path / "optim.pt", ALLOWED_GLOBALS)["loss_scaler"]
    assert not isinstance(loaded, DynamicLossScaler)
    assert vars(loaded) == vars(scaler)
