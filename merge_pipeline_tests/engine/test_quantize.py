"""``--quantize``: every data-free compressed-tensors scheme equals llm-compressor 0.14's ``model_free_ptq`` on the
bf16 merge of the same checkpoint, byte for byte (``.venv-llmcompressor``: ``scripts/setup_llmcompressor.sh``),
and loads in transformers (compressed-tensors decompresses it on the CPU) with nothing missing or unexpected."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers

from merge_pipeline.cli import main
from merge_pipeline.engine import quantize
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.quantization import SCHEMES, decide
from merge_pipeline.hub.model_card import render_card
from merge_pipeline.plan import PlannedTensor
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.engine.test_fp8 import LLAMA, TOKENS  # the same small Llama and text as --dtype fp8's
from merge_pipeline_tests.engine.test_resume import SPEC as RESUME_SPEC
from merge_pipeline_tests.engine.test_resume import killed_and_resumed
from merge_pipeline_tests.helpers import (
    TensorInPieces,
    assert_torchrun_writes_what_one_process_writes,
    cli_merge_command,
    error_lines,
    load_safetensors_dir,
    merge_error,
    merge_ok,
    run_cli,
    write_with_release,
)

DEFAULT_IGNORE = ["lm_head", "model.embed_tokens"]


def _trained(model: transformers.PreTrainedModel, folder: Path) -> Path:
    """``model`` taught ``TOKENS`` (so its next-token choices are clear ones), saved as a step folder
    NeMo-Automodel's way (``<role>/model/``, read with ``--backend hf``); returns the role folder."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        optimizer.zero_grad()
        model(TOKENS, labels=TOKENS).loss.backward()
        optimizer.step()
    model.to(torch.bfloat16).save_pretrained(folder / "model")
    return folder


def _trained_llama(root: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1003, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return _trained(transformers.LlamaForCausalLM(config), root / "global_step_1" / "actor")


def _trained_moe(root: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=1003, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return _trained(transformers.Qwen2MoeForCausalLM(config), root / "global_step_1" / "actor")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, fsdp_checkpoint):
    """name -> (role folder, merge flags, its bf16 merge, model_free_ptq's folder of each scheme, default ignore)."""
    root = tmp_path_factory.mktemp("quantize")
    sources = {
        "fsdp_llama": (fsdp_checkpoint(LLAMA).role_dir, (), DEFAULT_IGNORE),
        "llama": (_trained_llama(root / "llama"), ("--backend", "hf"), DEFAULT_IGNORE),
        "qwen2_moe": (
            _trained_moe(root / "moe"),
            ("--backend", "hf"),
            [
                *DEFAULT_IGNORE,
                *(f"model.layers.{i}.mlp.{m}" for i in range(2) for m in ("gate", "shared_expert_gate")),
            ],
        ),
    }
    prepared = {}
    for name, (role_dir, flags, ignore) in sources.items():
        bf16 = root / name / "bf16"
        merged = main(["merge", "--local_dir", str(role_dir), "--target_dir", str(bf16), "--dtype", "bfloat16", *flags])
        assert merged == 0, name
        references = write_with_release(
            ".venv-llmcompressor",
            "model_free_ptq.py",
            root / name / "reference",
            str(bf16),
            json.dumps(ignore),
            *SCHEMES,
        )
        prepared[name] = (role_dir, flags, bf16, references, ignore)
    return prepared


# Folders transformers 5.25 does not read right, llm-compressor's own the same (the bytes are equal): its MoE
# expert fusion on load multiplies MXFP8's group scales without expanding them (an error), and dequantizes
# NVFP4 experts without their global scale (weights off by about 1e4: its next tokens are noise).
UNLOADABLE = {("qwen2_moe", "MXFP8A16"): "CompressedTensorsDequantize on tensors destined for model.layers"}
MISREAD = {("qwen2_moe", "NVFP4A16")}


# Asymmetric schemes: transformers 5.25 builds their zero points one per row and refuses the packed ones that
# compressed-tensors writes (8 to an int32 row-wise, as vLLM and SGLang read them), in our folder and in
# llm-compressor's alike; compressed-tensors' own decompressor reads them.
PACKED_ZERO_POINTS = {"W4A16_ASYM"}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("model", ["fsdp_llama", "llama", "qwen2_moe"])
def test_quantized_merge_is_model_free_ptq_byte_for_byte(capsys, tmp_path, checkpoints, model, scheme):
    role_dir, flags, bf16, references, ignore = checkpoints[model]
    transformers.logging.set_verbosity_error()
    if (model, scheme) in UNLOADABLE:
        line = merge_error(capsys, role_dir, tmp_path / "out", "--quantize", scheme, *flags)
        assert "blocking check(s) loads_on_meta_device failed" in line
        with pytest.raises(RuntimeError, match="automatic conversion of the weights"):
            transformers.AutoModelForCausalLM.from_pretrained(references / scheme)
        return
    out = merge_ok(capsys, role_dir, tmp_path / "out", "--quantize", scheme, *flags)
    assert f"; {scheme}: " in out and f"{len(ignore)} modules kept in bfloat16 (0 off the scheme's groups)" in out
    ours, theirs = load_safetensors_dir(tmp_path / "out"), load_safetensors_dir(references / scheme)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    reference = json.loads((references / scheme / "config.json").read_text())["quantization_config"]
    assert config.pop("version") == reference.pop("version")  # the same compressed-tensors release
    assert config == reference and config["ignore"] == ignore
    manifest = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())
    assert manifest["decisions"]["quantization"]["scheme"] == scheme
    assert manifest["options"]["quantize"] == scheme

    if scheme in PACKED_ZERO_POINTS:
        loaders = "transformers 5.25, which builds the packed zero points unpacked (vLLM and SGLang load them)"
        assert out.rstrip().endswith(f"; not loaded by {loaders}"), out
        assert f"| not loaded by | {loaders} |" in render_card(manifest, "org/model")
        _assert_packed_zero_points_read_by_compressed_tensors(model, tmp_path / "out", references / scheme, bf16)
        return
    assert "not loaded by" not in out
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    # The trained models' next tokens (the FSDP sample's random weights have near-ties that 4 bits flip), at the
    # positions they were taught (after the last token there is no target: a near-tie too).
    if model != "fsdp_llama" and (model, scheme) not in MISREAD:
        reference_model = transformers.AutoModelForCausalLM.from_pretrained(bf16)
        with torch.no_grad():
            ours, theirs = loaded.eval()(TOKENS).logits.argmax(-1), reference_model.eval()(TOKENS).logits.argmax(-1)
        assert torch.equal(ours[0, :-1], theirs[0, :-1]) and torch.equal(ours[0, :-1], TOKENS[0, 1:])


def _assert_packed_zero_points_read_by_compressed_tensors(model: str, ours: Path, reference: Path, bf16: Path):
    """Each quantized weight, decompressed by compressed-tensors from the folder alone, is its bf16 weight within
    three quarters of its group's quantization step; the trained Llama with them predicts what it was taught. transformers fails
    on both folders alike (when a release reads them, this test says so)."""
    from compressed_tensors.compressors import compress_module, decompress_module
    from compressed_tensors.quantization import QuantizationConfig, initialize_module_for_quantization

    for folder in (ours, reference):
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes|automatic conversion of the weights"):
            transformers.AutoModelForCausalLM.from_pretrained(folder)
    config = QuantizationConfig.model_validate(json.loads((ours / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    stored, original = load_safetensors_dir(ours), load_safetensors_dir(bf16)
    dequantized = {}
    for name in (n.removesuffix(".weight_packed") for n in stored if n.endswith(".weight_packed")):
        weight = original[f"{name}.weight"]
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        initialize_module_for_quantization(module, scheme)
        compress_module(module)
        module.load_state_dict(
            {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(f"{name}.weight")}
        )
        decompress_module(module)
        step = stored[f"{name}.weight_scale"].float().repeat_interleave(scheme.weights.group_size, dim=1)
        error = (module.weight.float() - weight.float()).abs()
        # Half a step, and bfloat16's rounding of weight / scale and of the product back (measured: 0.59 at most);
        # a wrong scale, zero point or packing order is off by whole steps.
        assert (error <= 0.75 * step).all(), name
        dequantized[f"{name}.weight"] = module.weight.detach()
    assert len(dequantized) > 0
    if model == "llama":
        loaded = transformers.AutoModelForCausalLM.from_pretrained(bf16)
        loaded.load_state_dict(dequantized, strict=False)
        with torch.no_grad():
            predicted = loaded.eval()(TOKENS).logits.argmax(-1)
        assert torch.equal(predicted[0, :-1], TOKENS[0, 1:])


def test_inspect_lists_what_would_stay_unquantized(capsys, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(LLAMA).role_dir
    code, out, err = run_cli(capsys, "inspect", role_dir, "--quantize", "w4a16", "--json")
    assert code == 0, err
    assert json.loads(out)["quantization"] == {
        "scheme": "W4A16",
        "format": "pack-quantized",
        "quantized_weights": 14,
        "ignore": DEFAULT_IGNORE,
        "off_grid": [],
    }
    flags = ("--quantize", "MXFP8A16", "--quantize-ignore", "lm_head", "model.embed_tokens", "re:.*self_attn.*")
    code, out, err = run_cli(capsys, "inspect", role_dir, *flags, "--json")
    assert code == 0, err
    assert json.loads(out)["quantization"]["quantized_weights"] == 6  # the MLPs of two layers


def test_off_grid_weights_stay_in_bfloat16_and_are_ignored(capsys, tmp_path, fsdp_checkpoint):
    """Columns no multiple of the group size: kept, listed, and named in config.json's ignore."""
    role_dir = fsdp_checkpoint(FsdpSpec(arch="llama", hidden_size=256, intermediate_size=96)).role_dir
    out = merge_ok(capsys, role_dir, tmp_path / "out", "--quantize", "W4A16")
    assert "W4A16: 12 weights quantized (pack-quantized), 4 modules kept in bfloat16 (2 off the scheme's groups)" in out
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["ignore"] == [*DEFAULT_IGNORE, "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    written = load_safetensors_dir(tmp_path / "out")
    assert written["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert written["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.int32
    card = render_card(json.loads((tmp_path / "out" / "merge_manifest.json").read_text()), "org/model")
    assert "| weights | 12 linear weights in W4A16 (compressed-tensors pack-quantized) |" in card
    kept = "`lm_head`, `model.embed_tokens`, `model.layers.0.mlp.down_proj`, `model.layers.1.mlp.down_proj`"
    assert f"| kept in bfloat16 | {kept} (and every norm and bias); 2 of them off the scheme's groups |" in card


@pytest.mark.parametrize(
    "scheme, problem",
    [
        (
            "NVFP4",
            "--quantize NVFP4 quantizes activations with scales calibrated on data, which a merge has none of: use"
            " NVFP4A16 (its weights, activations left in 16 bits)",
        ),
        (
            "FP8",
            "--quantize FP8 quantizes activations with scales calibrated on data, which a merge has none of: use"
            " FP8_DYNAMIC (its weights, activations left in 16 bits)",
        ),
        ("W8A8", "--quantize W8A8 is not yet supported: one of " + ", ".join(SCHEMES)),
        ("INT3", "--quantize INT3: no compressed-tensors preset of that name; one of " + ", ".join(SCHEMES)),
    ],
)
def test_other_schemes_are_refused_in_one_line(capsys, tmp_path, fsdp_checkpoint, scheme, problem):
    role_dir = fsdp_checkpoint(LLAMA).role_dir
    line = merge_error(capsys, role_dir, tmp_path / "out", "--quantize", scheme)
    assert line.startswith(f"error: {role_dir}: {problem}"), line
    code, _, err = run_cli(capsys, "inspect", role_dir, "--quantize", scheme)
    assert code == 1 and error_lines(err) == [line]


def test_a_killed_quantized_merge_resumes(tmp_path):
    """A killed ``--quantize`` merge started again reuses the files it finished, bit-identical to an uninterrupted
    merge; the options it is keyed by (test_resume.py: a changed one starts over) hold the scheme and the list."""
    role_dir = tmp_path / "global_step_1" / "actor"
    write_fake_pg_checkpoint(role_dir, RESUME_SPEC)

    def command(target: Path) -> list[str]:
        return cli_merge_command(role_dir, target, "--quantize", "W4A16", "--max-shard-size", "8MB")

    subprocess.run(command(tmp_path / "uninterrupted"), check=True, capture_output=True)
    killed_and_resumed(command(tmp_path / "out"), tmp_path / "out", tmp_path / "uninterrupted")
    manifest = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())
    assert manifest["options"]["quantize"] == "W4A16" and manifest["options"]["quantize_ignore"] == []
    assert manifest["decisions"]["quantization"]["ignore"] == DEFAULT_IGNORE


@pytest.mark.torchrun
def test_torchrun_ranks_quantize_their_own_shards_byte_identically(capsys, tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(LLAMA).role_dir
    flags = ("--max-shard-size", "200KB", "--quantize", "NVFP4A16")  # a global scale shared across shards too
    assert_torchrun_writes_what_one_process_writes(capsys, role_dir, tmp_path, *flags)


def _planned(name: str, weight: torch.Tensor) -> PlannedTensor:
    return PlannedTensor(name, tuple(weight.shape), weight.dtype, TensorInPieces(weight, 1000))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bands_stacked_are_the_whole_tensor_quantized_at_once(monkeypatch, scheme):
    """300 rows in bands of 128 (the last one short), read in pieces that end mid-row: the written tensors are
    compressed-tensors' output for the whole weight, quantized in one call."""
    monkeypatch.setattr(quantize, "READ_PIECE_BYTES", 1)  # one band of 128 rows at a time
    torch.manual_seed(0)
    weights = {f"model.layers.0.self_attn.{p}_proj.weight": torch.randn(300, 256) for p in "qkv"}
    planned = [_planned(name, weight) for name, weight in weights.items()]
    decisions = decide(planned, scheme, (), Path("."))
    sets = quantize._global_scale_sets(decisions, {t.name: t for t in planned})
    fused = max(w.to(torch.bfloat16).abs().max() for w in weights.values())
    layouts = {}  # shared, as the merge shares it: k and v take q's
    for t in planned:
        leader, followers = quantize._quantized(t, decisions, sets[t.name], layouts)
        written = {leader.planned.name: torch.cat([p.reshape(-1) for p in leader.planned.source.pieces()])}
        written |= {f.planned.name: next(iter(f.planned.source.pieces())) for f in followers}
        is_global = decisions.scheme.weights.strategy == "tensor_group"
        whole = quantize.quantize_band(
            weights[t.name].to(torch.bfloat16), decisions.scheme, quantize.global_scale_of(fused) if is_global else None
        )
        module = t.name.removesuffix(".weight")
        assert sorted(written) == sorted(f"{module}.{key}" for key in whole)
        for key, value in whole.items():
            ours = written[f"{module}.{key}"]
            assert ours.dtype == value.dtype and ours.numel() == value.numel(), key
            assert torch.equal(ours.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), key


def test_a_weight_with_nan_is_one_line_naming_it():
    weight = torch.ones(256, 256)
    weight[200, 4] = float("nan")
    planned = _planned("model.layers.0.mlp.down_proj.weight", weight)
    decisions = decide([planned], "W4A16", (), Path("."))
    leader, _ = quantize._quantized(planned, decisions, [planned], {})
    with pytest.raises(MergeError, match=r"down_proj\.weight holds inf or NaN: it cannot be quantized$"):
        list(leader.planned.source.pieces())


def test_average_quantizes_the_average(capsys, tmp_path, fsdp_checkpoint):
    """Two copies of one bf16 merge averaged: the average is that merge, so its quantized folder is the
    quantized merge's, tensor for tensor."""
    role_dir = fsdp_checkpoint(LLAMA).role_dir
    merge_ok(capsys, role_dir, tmp_path / "a", "--dtype", "bfloat16")
    merge_ok(capsys, role_dir, tmp_path / "q", "--quantize", "W4A16")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    inputs = ("--inputs", tmp_path / "a", tmp_path / "b")
    code, _, err = run_cli(capsys, "average", *inputs, "--target_dir", tmp_path / "avg", "--quantize", "W4A16")
    assert code == 0, err
    averaged, merged = load_safetensors_dir(tmp_path / "avg"), load_safetensors_dir(tmp_path / "q")
    assert sorted(averaged) == sorted(merged)
    assert all(
        torch.equal(averaged[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)) for n, t in merged.items()
    )
