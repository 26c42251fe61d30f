"""``--dtype fp8``: the scale rule against its reference, the folder against transformers' own FP8 loader."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers import FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
from transformers.quantizers.auto import AutoHfQuantizer

from merge_pipeline.engine.fp8_quantize import quantized_pair
from merge_pipeline.formats import open_checkpoint
from merge_pipeline.hf.architecture import expected_tensors
from merge_pipeline.hf.config import CheckpointConfig
from merge_pipeline.hf.folder_checks import meta_load_problems
from merge_pipeline.hf.fp8 import FP8, decide_fp8, dequantize
from merge_pipeline.hub.model_card import render_card
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.inspect import checkpoint_facts
from merge_pipeline.plan import Computed, PlannedTensor
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.conftest import copy_checkpoint
from merge_pipeline_tests.helpers import (
    TensorInPieces,
    assert_torchrun_writes_what_one_process_writes,
    error_lines,
    load_safetensors_dir,
    merge_error,
    merge_ok,
    run_cli,
    same_bits,
)

LLAMA = FsdpSpec(
    arch="llama", world_size=2, hidden_size=256, intermediate_size=512, vocab_size=1003, with_optimizer=False
)
TOKENS = torch.tensor([[1, 5, 17, 200, 40, 999, 3, 64]])


def reference_quantize(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Transcribed from transformers 5.24's ``Fp8Quantize._quantize_one``
    (transformers/integrations/finegrained_fp8.py), the quantizer of the FP8 format its loader reads:
    per ``block x block`` tile ``max_abs = amax(|x|)``; ``scales = 448 / max_abs`` (1 where max_abs is 0);
    ``inv_scales = (1 / scales).float()``; ``clamp(x * scales, -448, 448).to(float8_e4m3fn)``."""
    rows, cols = x.shape
    tiles = x.to(torch.float32).reshape(rows // block, block, cols // block, block)
    max_abs = tiles.abs().amax(dim=(-3, -1))
    safe_max_abs = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = 448.0 / safe_max_abs
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv_scales = (1.0 / scales).to(torch.float32)
    quantized = torch.clamp(tiles * scales.unsqueeze(-1).unsqueeze(-3), min=-448.0, max=448.0).to(FP8)
    return quantized.reshape(rows, cols), inv_scales


def _write_pair(weight: torch.Tensor, block: int, source=None) -> tuple[torch.Tensor, torch.Tensor]:
    planned = PlannedTensor("m.weight", tuple(weight.shape), weight.dtype, source or Computed(lambda: weight))
    fp8, scales = quantized_pair(planned, block)
    q = torch.cat([p.reshape(-1) for p in fp8.planned.source.pieces()]).view(weight.shape)
    return q, next(iter(scales.planned.source.pieces()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizer_is_bit_identical_to_the_reference(dtype):
    torch.manual_seed(0)
    cols = 16384  # a band of 128 rows is one 8 MB read piece: three bands, quantized one group each
    weight = (torch.randn(384, cols) * torch.logspace(-3, 1, cols)).to(dtype)
    weight[:128, 128:256] = 0  # a zero tile
    weight[128:256, :128] = 3e-39  # a tile below FP8's range: transformers' rule would write NaN for its zeros
    weight[128, 0] = 0
    block = 128
    expected_q, expected_s = reference_quantize(weight, block)
    theirs = Fp8Quantize(AutoHfQuantizer.from_config(FineGrainedFP8Config(weight_block_size=(block, block))))
    ran = theirs._quantize_one("m.weight", weight)
    for source in (None, TensorInPieces(weight, 100_003)):  # one whole piece, and pieces across band boundaries
        q, s = _write_pair(weight, block, source)
        on_grid = torch.ones_like(s, dtype=torch.bool)
        on_grid[1, 0] = False  # the sub-range tile: the one place the rules differ (see engine/fp8_quantize.py)
        assert same_bits(s[on_grid], expected_s[on_grid]) and same_bits(s[on_grid], ran["m.weight_scale_inv"][on_grid])
        rows = torch.ones(384, dtype=torch.bool)
        rows[128:256] = False
        assert same_bits(q[rows], expected_q[rows]) and same_bits(q[rows], ran["m.weight"][rows])
        assert same_bits(q[128:256, 128:], expected_q[128:256, 128:])
        back = dequantize(q, s, block)
        assert not back.isnan().any()
        assert torch.equal(back[:128, 128:256], torch.zeros(128, 128)) and torch.equal(
            back[128:256, :128], torch.zeros(128, 128)
        )


def test_representable_values_round_trip_exactly_and_errors_stay_within_e4m3():
    torch.manual_seed(1)
    block = 32
    grid = torch.tensor([0.0, 1.0, -2.0, 0.5, 448.0, -448.0, 0.015625, 3.5])  # e4m3 values with amax 448
    exact = grid[torch.randint(0, len(grid), (64, 64))] * 2.0**-6
    exact[0, 0] = exact[32, 32] = exact[0, 32] = exact[32, 0] = 448 * 2.0**-6  # amax 7 in every tile: scale 1/64
    q, s = _write_pair(exact, block)
    assert torch.equal(dequantize(q, s, block), exact)
    noisy = torch.randn(64, 96) * 10
    q, s = _write_pair(noisy, block)
    tiles_scale = s.repeat_interleave(block, 0).repeat_interleave(block, 1)
    half_ulp = torch.maximum(
        q.float().abs() * 2.0**-4, torch.tensor(2.0**-10)
    )  # e4m3: 3 mantissa bits, subnormals 2^-9
    assert ((dequantize(q, s, block) - noisy).abs() <= half_ulp * tiles_scale * 1.0001).all()


def test_a_weight_with_nan_is_one_line_naming_it():
    weight = torch.ones(128, 128)
    weight[3, 4] = float("nan")
    with pytest.raises(Exception, match=r"m\.weight holds inf or NaN: it cannot be quantized to FP8"):
        _write_pair(weight, 128)


def _check_loads_like_the_bf16_merge(
    folder: Path, bf16_folder: Path, source: dict[str, torch.Tensor], block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' FP8 loader (dequantizing on CPU) takes the folder whole; its weights are our
    dequantization of the written bytes, within e4m3 of the source; its logits point the bf16 merge's
    way. Returns both next-token argmaxes."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    written = load_safetensors_dir(folder)
    loaded = model.state_dict()
    dequantizer = Fp8Dequantize(None)
    quantized = [n for n in written if n.endswith(".weight") and n + "_scale_inv" in written]
    assert quantized
    for name in quantized:
        q, s = written[name], written[name + "_scale_inv"]
        ours = dequantize(q, s, block)
        assert torch.equal(ours.to(torch.bfloat16), dequantizer._dequantize_one(q, s, torch.bfloat16))
        if name in loaded:  # fused experts are loaded under other names: the dequantizer check above covers them
            assert torch.equal(loaded[name], ours.to(torch.bfloat16)), name
        amax = source[name].float().abs().reshape(q.shape[0] // block, block, -1, block).amax(dim=(1, 3))
        bound = amax.repeat_interleave(block, 0).repeat_interleave(block, 1) / 448 * 28  # 448 * 2^-4
        assert ((ours - source[name].float()).abs() <= bound).all(), name
    reference = transformers.AutoModelForCausalLM.from_pretrained(bf16_folder).eval()
    with torch.no_grad():
        ours, theirs = model.eval()(TOKENS).logits.float(), reference(TOKENS).logits.float()
    assert (torch.nn.functional.cosine_similarity(ours, theirs, dim=-1) > 0.99).all()
    return ours.argmax(-1), theirs.argmax(-1)


def test_llama_fp8_folder_loads_in_transformers(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LLAMA)
    out = merge_ok(capsys, sample.role_dir, tmp_path / "fp8", "--dtype", "fp8")
    assert "fp8: 14 weights quantized in 128x128 blocks, 2 modules kept in bfloat16 (0 off the block grid)" in out
    merge_ok(capsys, sample.role_dir, tmp_path / "bf16", "--dtype", "bfloat16")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"],
    }
    written = load_safetensors_dir(tmp_path / "fp8")
    assert written["model.layers.0.mlp.down_proj.weight"].dtype == FP8
    assert written["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 4)
    assert written["model.norm.weight"].dtype == written["lm_head.weight"].dtype == torch.bfloat16
    manifest = json.loads((tmp_path / "fp8" / "merge_manifest.json").read_text())
    assert manifest["decisions"]["fp8"]["quantized_weights"] == 14
    assert meta_load_problems(tmp_path / "fp8") == []  # the check Dagster runs on every merged folder
    card = render_card(manifest, "org/model")
    assert "| weights | 14 linear weights in FP8 (e4m3, one scale per 128x128 block) |" in card
    assert "| kept in bfloat16 | `lm_head`, `model.embed_tokens` (and every norm and bias) |" in card
    ours, theirs = _check_loads_like_the_bf16_merge(
        tmp_path / "fp8", tmp_path / "bf16", load_file(sample.reference_dir / "model.safetensors"), 128
    )
    assert (ours == theirs).sum() >= 7  # an untrained model: near-ties in its logits may flip (the MoE test is trained)
    code, out, err = run_cli(capsys, "inspect", sample.role_dir, "--dtype", "fp8", "--json")
    assert code == 0, err
    assert json.loads(out)["fp8"] == manifest["decisions"]["fp8"]


def test_a_finished_merge_shows_its_recorded_plan_not_a_second_one(capsys, tmp_path, fsdp_checkpoint):
    """Dagster's parallel_config describes the published merge by its manifest's decisions: the FP8 plan
    shown is the one the merge made, not one planned again after it."""
    sample = fsdp_checkpoint(LLAMA)
    merge_ok(capsys, sample.role_dir, tmp_path / "fp8", "--dtype", "fp8")
    decisions = json.loads((tmp_path / "fp8" / "merge_manifest.json").read_text())["decisions"]
    options = MergeOptions(dtype="fp8")
    configs = CheckpointConfig.of(sample.role_dir, options)
    with open_checkpoint(sample.role_dir, options, configs) as plan:
        facts = checkpoint_facts(plan, options, configs.load(plan.hf_dir), decisions)
    assert facts["fp8"] is decisions["fp8"]


def test_off_grid_weights_stay_in_bfloat16_and_are_listed(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(LLAMA)
    out = merge_ok(capsys, sample.role_dir, tmp_path / "fp8", "--dtype", "fp8", "--fp8-block-size", "256")
    # 256 divides q/o_proj (256x256) and the MLP (256x512, 512x256), not k/v_proj (128x256)
    assert "10 weights quantized in 256x256 blocks, 6 modules kept in bfloat16 (4 off the block grid)" in out
    written = load_safetensors_dir(tmp_path / "fp8")
    assert written["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16
    assert written["model.layers.0.self_attn.q_proj.weight"].dtype == FP8
    kept = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.1.self_attn.v_proj" in kept
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize(
    "spec, block, instead",
    [
        # the demo's model: every linear weight 32 to 128 wide, none on the default 128 grid
        (
            FsdpSpec(),
            "128",
            "model.layers.0.self_attn.q_proj.weight is 64x64), and the folder would claim FP8 with "
            "every weight in bfloat16; pass --fp8-block-size 32 (it divides all their dimensions) or another --dtype",
        ),
        # 96 divides none of 128, 256, 512
        (
            LLAMA,
            "96",
            "model.layers.0.self_attn.q_proj.weight is 256x256), and the folder would claim FP8 with "
            "every weight in bfloat16; pass --fp8-block-size 128 (it divides all their dimensions) or another --dtype",
        ),
    ],
)
def test_fp8_that_would_quantize_nothing_is_refused_in_one_line(
    capsys, tmp_path, fsdp_checkpoint, spec, block, instead
):
    """A folder with a quantization_config and no FP8 weight is one loaders take for an FP8 model: refused
    before anything is written, by merge and inspect alike (the plan is made in one place)."""
    role_dir = fsdp_checkpoint(spec).role_dir
    expected = (
        f"error: {role_dir}: --dtype fp8 would quantize nothing: none of the 14 linear weights lies on the "
        f"{block}x{block} block grid (both dimensions multiples of {block}; {instead} (e.g. bfloat16)"
    )
    target = tmp_path / "out" / "global_step_1" / "actor"
    flags = ("--dtype", "fp8", "--fp8-block-size", block)
    assert merge_error(capsys, role_dir, target, *flags) == expected
    assert not (tmp_path / "out").exists()  # nor a quantization_config anywhere
    code, _, err = run_cli(capsys, "inspect", role_dir, *flags)
    assert code == 1 and error_lines(err) == [expected]
    suggested = expected.split("--fp8-block-size ")[1].split()[0]
    out = merge_ok(capsys, role_dir, target, "--dtype", "fp8", "--fp8-block-size", suggested)
    assert f"fp8: 14 weights quantized in {suggested}x{suggested} blocks" in out


@pytest.mark.torchrun
def test_torchrun_ranks_quantize_their_own_shards_byte_identically(capsys, tmp_path, fsdp_checkpoint):
    role_dir = fsdp_checkpoint(LLAMA).role_dir
    assert_torchrun_writes_what_one_process_writes(
        capsys, role_dir, tmp_path, "--max-shard-size", "200KB", "--dtype", "fp8"
    )


def test_lora_fp8_needs_merge_lora(capsys, tmp_path, fsdp_checkpoint):
    sample = fsdp_checkpoint(FsdpSpec(lora=(4, 8)))  # the LoRA spec other tests use: written once a session
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--dtype", "fp8"
    )
    assert code == 1 and "--dtype fp8 quantizes base weights" in err and "add --merge-lora" in err
    assert not (tmp_path / "out").exists()
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--quantize", "W8A16"
    )
    assert code == 1 and "--quantize quantizes base weights" in err and not (tmp_path / "out").exists()
    flags = ("--fp8-block-size", "32", "--merge-lora")
    out = merge_ok(capsys, sample.role_dir, tmp_path / "out", "--dtype", "fp8", *flags)
    assert "fp8: 14 weights quantized in 32x32 blocks" in out
    merge_ok(capsys, sample.role_dir, tmp_path / "fp32", *flags)
    written, folded = load_safetensors_dir(tmp_path / "out"), load_safetensors_dir(tmp_path / "fp32")
    assert not any("lora" in name for name in written)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight"):
        q, s = reference_quantize(folded[name], 32)  # quantized after folding: W + (alpha / r) B A
        assert same_bits(written[name], q) and same_bits(written[name + "_scale_inv"], s)


@pytest.mark.slow
def test_moe_fp8_folder_loads_in_transformers(capsys, tmp_path):
    """A small Qwen2-MoE saved by transformers itself (a consolidated HF folder, ``--backend hf``)."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=1003,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.Qwen2MoeForCausalLM(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):  # learn the text, so the next-token choices are clear ones
        optimizer.zero_grad()
        model(TOKENS, labels=TOKENS).loss.backward()
        optimizer.step()
    role_dir = tmp_path / "global_step_1" / "actor"  # NeMo-Automodel's layout: <role>/model/
    model.to(torch.bfloat16).save_pretrained(role_dir / "model")
    merge_ok(capsys, role_dir, tmp_path / "fp8", "--backend", "hf", "--dtype", "fp8", "--fp8-block-size", "32")
    merge_ok(capsys, role_dir, tmp_path / "bf16", "--backend", "hf")
    quantization = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert quantization["modules_to_not_convert"] == [
        "lm_head",
        "model.embed_tokens",
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.shared_expert_gate",
    ]
    written = load_safetensors_dir(tmp_path / "fp8")
    assert written["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == FP8
    again = tmp_path / "again" / "actor"
    shutil.copytree(tmp_path / "fp8", again / "model")
    code, _, err = run_cli(capsys, "merge", "--local_dir", again, "--target_dir", tmp_path / "twice", "--dtype", "fp8")
    assert code == 1 and not (tmp_path / "twice").exists()
    assert error_lines(err) == [
        f"error: {again}: model.layers.0.mlp.experts.0.down_proj.weight is already quantized: --dtype fp8 takes unquantized weights"
    ]
    ours, theirs = _check_loads_like_the_bf16_merge(
        tmp_path / "fp8", tmp_path / "bf16", load_safetensors_dir(role_dir / "model"), 32
    )
    assert torch.equal(ours, theirs) and torch.equal(ours[0, :-1], TOKENS[0, 1:])


def _config_dir(tmp_path: Path, config) -> Path:
    folder = tmp_path / config.model_type
    config.save_pretrained(folder)
    return folder


def _in_memory_name(model, name: str) -> str:
    """A checkpoint name as transformers renames it on load (its own conversion mapping)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    for rename in get_model_conversion_mapping(model):
        name, _ = rename.rename_source_key(name)
    return name


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "deepseek_v3", "qwen2_5_vl"])
def test_kept_precision_list_per_architecture(tmp_path, family):
    """The kept list from the names transformers' own meta model has, and the linear layers its FP8
    integration would replace on a GPU are exactly the ones we quantize."""
    small = dict(hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, vocab_size=1000)
    configs = {
        "llama": transformers.LlamaConfig(intermediate_size=512, **small),
        "qwen2_moe": transformers.Qwen2MoeConfig(
            intermediate_size=512,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=256,
            num_experts=2,
            **small,
        ),
        "deepseek_v3": transformers.DeepseekV3Config(
            intermediate_size=512,
            moe_intermediate_size=256,
            n_routed_experts=2,
            n_shared_experts=1,
            num_experts_per_tok=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            q_lora_rank=128,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            **small,
        ),
        "qwen2_5_vl": transformers.Qwen2_5_VLConfig(
            text_config=dict(intermediate_size=512, **small),
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=256),
            architectures=["Qwen2_5_VLForConditionalGeneration"],
        ),
    }
    expected = expected_tensors(_config_dir(tmp_path, configs[family]), value_model=False, trust_remote_code=False)
    tensors = [PlannedTensor(n, s, torch.bfloat16, Computed(torch.empty)) for n, s in expected.items()]
    decisions = decide_fp8(tensors, 128, tmp_path)
    # DeepSeek-V3: kv_a_proj_with_mqa has kv_lora_rank + qk_rope_head_dim rows (576 in the real model; 192
    # here), off the 128-grid; layer 1 is the multi-token-prediction layer (its embedding, head and eh_proj kept).
    kept = {
        "llama": ["lm_head", "model.embed_tokens"],
        "qwen2_moe": [
            "lm_head",
            "model.embed_tokens",
            "model.layers.0.mlp.gate",
            "model.layers.0.mlp.shared_expert_gate",
        ],
        "deepseek_v3": [
            "lm_head",
            "model.embed_tokens",
            "model.layers.0.mlp.gate",
            "model.layers.0.self_attn.kv_a_proj_with_mqa",
            "model.layers.1.eh_proj",
            "model.layers.1.embed_tokens",
            "model.layers.1.mlp.gate",
            "model.layers.1.self_attn.kv_a_proj_with_mqa",
            "model.layers.1.shared_head.head",
        ],
        "qwen2_5_vl": [
            "lm_head",
            "model.embed_tokens",
            "visual",
        ],  # on disk: the names before transformers 5 renamed them
    }[family]
    assert decisions.kept == kept
    off_grid = (
        [f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in (0, 1)] if family == "deepseek_v3" else []
    )
    assert decisions.off_grid == off_grid
    # transformers' FP8 integration on a meta model, as on a GPU: every nn.Linear it turns into an
    # FP8Linear is one we quantize, and the rest of what we quantize are MoE experts (FP8Experts) or
    # the MTP layer transformers does not build.
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    with torch.device("meta"):
        model = (
            transformers.Qwen2_5_VLForConditionalGeneration(configs[family])
            if family == "qwen2_5_vl"
            else transformers.AutoModelForCausalLM.from_config(configs[family])
        )
    quantizer = AutoHfQuantizer.from_config(
        FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=decisions.kept), pre_quantized=True
    )
    quantizer.quantization_config.dequantize = False
    quantizer._process_model_before_weight_loading(model)
    modules = dict(model.named_modules())
    fp8_linear = {f"{n}.weight" for n, m in modules.items() if isinstance(m, FP8Linear)}
    experts = tuple(f"{n}." for n, m in modules.items() if isinstance(m, FP8Experts))
    built = {f"{n}.weight" for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    quantized = {_in_memory_name(model, n) for n in decisions.quantized}  # Qwen2.5-VL: model.language_model.*
    assert fp8_linear == quantized & built
    mtp = "model.layers.1." if family == "deepseek_v3" else "(none)"
    assert all(n in built or n.startswith(experts) or n.startswith(mtp) for n in quantized)
    assert bool(experts) == (family in ("qwen2_moe", "deepseek_v3"))


def test_a_source_quantization_config_is_left_out_of_a_plain_merge(capsys, caplog, tmp_path, fsdp_checkpoint):
    """A fine-tune of a quantized base (gpt-oss's MXFP4, trained dequantized) saves the base's config: its
    quantization_config would make loaders read the plain merged weights as quantized ones."""
    sample = copy_checkpoint(fsdp_checkpoint(LLAMA), tmp_path / "actor")
    config_path = sample.role_dir / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))

    caplog.set_level(logging.WARNING, logger="merge_pipeline")
    code, _, err = run_cli(capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out")

    assert code == 0, err
    assert "quantization_config (mxfp4) left out: the merged weights are not quantized" in caplog.text
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta_load_problems(tmp_path / "out") == []
