"""Megatron MoE and multi-token-prediction models verl trains: Mixtral (``block_sparse_moe``, no shared
expert, EP=2), DeepSeek-V3 (multi-latent attention, dense then MoE layers, sigmoid router with
expert bias, one MTP module, EP=2) and GLM-4.5 (q/k/v biases, QK-norm, rotary on half of each head,
dense then MoE layers, sigmoid router with expert bias, shared experts, one MTP module, EP=2) and gpt-oss
(attention sinks, biases on every linear, a biased router, clamped ``(up + 1) * quick_gelu(gate)`` experts
that HF keeps grouped per layer, transposed, gate and up interleaved; EP=2, and TP=2 with one key per
layer and expert, fc1's gate and up as ``weight_w`` / ``weight_v``, sinks split over the TP ranks), all
written by megatron-core on gloo ranks. Merged from the CLI, bit-exact, and the merged folder computes
what megatron-core computed.

Qwen3-MoE (QK-norm, no bias) is proven the same way by
``test_cli.py::test_merged_model_reproduces_megatron_logits[qwen3_moe_tp2_per_layer]``.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from merge_pipeline.cli import main
from merge_pipeline.formats import open_checkpoint
from merge_pipeline.options import MergeOptions
from merge_pipeline_samples.megatron import MLA_SIZES, SIZE_PRESETS, global_values, sample_tokens
from merge_pipeline_tests.helpers import error_lines, load_safetensors_dir, run_cli, same_bits, tree_digest

FAMILIES = ["mixtral_ep2", "deepseek_v3_mtp", "glm4_moe_mtp", "gpt_oss_ep2", "gpt_oss_tp2_per_layer"]
MTP = ("deepseek_v3_mtp", "glm4_moe_mtp")
SIZES = SIZE_PRESETS["tiny"]


@pytest.fixture(scope="module")
def merged(megatron_samples, tmp_path_factory):
    """Each variant merged once with ``merge-pipeline merge`` (backend detected), inputs untouched."""
    targets = {}
    for name in FAMILIES:
        role_dir = megatron_samples[name].role_dir
        before = tree_digest(role_dir)
        target = tmp_path_factory.mktemp(name) / "out"
        assert main(["merge", "--local_dir", str(role_dir), "--target_dir", str(target), "--no-progress"]) == 0
        assert tree_digest(role_dir) == before
        targets[name] = target
    return targets


@pytest.mark.parametrize("name", FAMILIES)
def test_merged_files_hold_the_source_weights_bit_for_bit(megatron_samples, merged, name):
    files = load_safetensors_dir(merged[name])
    reference = load_file(megatron_samples[name].reference_dir / "model.safetensors")
    assert set(files) == set(reference)
    assert [k for k in reference if not same_bits(files[k], reference[k])] == []


@pytest.mark.parametrize("name", FAMILIES)
def test_merged_model_reproduces_megatron_logits(megatron_samples, merged, name):
    model, loading = transformers.AutoModelForCausalLM.from_pretrained(
        merged[name], dtype=torch.float32, output_loading_info=True
    )
    assert not loading["missing_keys"] and not loading["mismatched_keys"]
    # transformers has no MTP module: it skips layer num_hidden_layers, and only that.
    mtp_layer = f"model.layers.{model.config.num_hidden_layers}."
    assert all(k.startswith(mtp_layer) for k in loading["unexpected_keys"])
    assert bool(loading["unexpected_keys"]) == (name in MTP)
    with torch.no_grad():
        logits = model.eval()(sample_tokens()[None]).logits[0]
    expected = torch.load(megatron_samples[name].logits_path, weights_only=True)
    assert expected.abs().max() > 1.0  # not a degenerate model
    # Both sides run float32 from the same bits; they differ only in operation order (megatron-core's
    # baddbmm attention vs transformers' SDPA, expert outputs summed by the allgather dispatcher's
    # scatter-add vs transformers' index_add, softmax of the top-k logits vs softmax-top-k-renormalise).
    # Measured: max |difference| 1.0e-6 (Mixtral), 1.3e-6 (DeepSeek-V3), 1.3e-6 (GLM-4.5), 9.8e-7 and
    # 1.3e-6 (gpt-oss) on logits up to 2.6, i.e. a few float32 ulps. Mistakes measured on the same folders: two
    # experts swapped 0.59, gate/up halves swapped 0.88, router bias dropped 0.80, one MLA norm reversed
    # 0.07; GLM-4.5 with full rotary 1.33, routed_scaling_factor 1.0 0.95, top-k weights not renormalised
    # 0.43; gpt-oss with gate/up not interleaved 2.2, two experts' down_proj swapped 1.9, router bias
    # zeroed 0.45, sinks zeroed 0.23.
    torch.testing.assert_close(logits, expected, atol=5e-6, rtol=0)


def test_gpt_oss_experts_are_grouped_transposed_and_interleaved(merged):
    """HF's gpt-oss layout, checked against megatron-core's stored tensors directly: per layer one
    ``gate_up_proj`` [E, hidden, 2 x ffn] whose column 2j is gate row j of fc1 and 2j + 1 its up row j,
    ``down_proj`` [E, ffn, hidden] (fc2 transposed), their biases, the router's bias and the sinks."""
    files = load_safetensors_dir(merged["gpt_oss_ep2"])
    layers, experts, hidden, ffn, heads = (SIZES[k] for k in ("layers", "experts", "hidden", "moe_ffn", "heads"))
    stored = "decoder.layers."

    def values(name: str, *shape: int) -> torch.Tensor:
        return global_values(stored + name, (layers, *shape), torch.float32)

    fc1 = values("mlp.experts.experts.linear_fc1.weight", experts, 2 * ffn, hidden)
    fc1_bias = values("mlp.experts.experts.linear_fc1.bias", experts, 2 * ffn)
    fc2 = values("mlp.experts.experts.linear_fc2.weight", experts, hidden, ffn)
    p = "model.layers.2."
    gate_up, gate_up_bias = files[p + "mlp.experts.gate_up_proj"], files[p + "mlp.experts.gate_up_proj_bias"]
    assert gate_up.shape == (experts, hidden, 2 * ffn) and gate_up_bias.shape == (experts, 2 * ffn)
    assert same_bits(gate_up[3][:, 0::2], fc1[2, 3, :ffn].t()) and same_bits(gate_up[3][:, 1::2], fc1[2, 3, ffn:].t())
    assert same_bits(gate_up_bias[1][0::2], fc1_bias[2, 1, :ffn]) and same_bits(
        gate_up_bias[1][1::2], fc1_bias[2, 1, ffn:]
    )
    assert files[p + "mlp.experts.down_proj"].shape == (experts, ffn, hidden)
    assert same_bits(files[p + "mlp.experts.down_proj"][1], fc2[2, 1].t())
    assert same_bits(
        files[p + "mlp.experts.down_proj_bias"], values("mlp.experts.experts.linear_fc2.bias", experts, hidden)[2]
    )
    assert same_bits(files[p + "mlp.router.bias"], values("mlp.router.bias", experts)[2])
    assert same_bits(files[p + "self_attn.sinks"], values("self_attention.core_attention.softmax_offset", heads)[2])
    assert not [n for n in files if ".experts.0." in n or "mlp.gate." in n]


def test_gpt_oss_experts_are_read_one_expert_matrix_at_a_time(megatron_samples):
    """The transposed layout is built from the stored experts as they stream: the plan yields each
    layer's ``gate_up_proj`` as one expert's matrix after another, never the layer's whole tensor."""
    hidden, ffn, experts = SIZES["hidden"], SIZES["moe_ffn"], SIZES["experts"]
    with open_checkpoint(megatron_samples["gpt_oss_ep2"].role_dir, MergeOptions()) as plan:
        gate_up = next(t for t in plan.tensors if t.name == "model.layers.1.mlp.experts.gate_up_proj")
        sizes = [piece.numel() for piece in gate_up.source.pieces()]
    assert gate_up.shape == (experts, hidden, 2 * ffn)
    assert sizes == [hidden * 2 * ffn] * experts


def test_mixtral_experts_keep_the_hub_names(merged):
    """As MixtralForCausalLM checkpoints on the Hub: transformers 5 renames ``block_sparse_moe`` to
    ``mlp`` and fuses w1/w3 into ``gate_up_proj`` on load, and reverses both when saving."""
    names = set(load_safetensors_dir(merged["mixtral_ep2"]))
    moe = "model.layers.3.block_sparse_moe."
    experts = {f"{moe}experts.{e}.{w}.weight" for e in range(SIZES["experts"]) for w in ("w1", "w2", "w3")}
    assert experts | {f"{moe}gate.weight"} <= names
    assert not [n for n in names if ".mlp." in n or "shared" in n]


def test_mtp_module_is_layer_num_hidden_layers_with_deepseek_names(merged):
    """megatron-core's ``mtp.layers.0.*`` -> ``model.layers.2.*`` as in DeepSeek-V3's own checkpoint
    (and vLLM's deepseek_mtp loader), copied bit for bit from the stored tensors."""
    out = merged["deepseek_v3_mtp"]
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    files = load_safetensors_dir(out)
    hidden, vocab, m = SIZES["hidden"], SIZES["vocab"], MLA_SIZES
    mtp = "mtp.layers.0."
    own = {  # HF name -> (megatron-core key, shape)
        "enorm.weight": (mtp + "enorm.weight", (hidden,)),
        "hnorm.weight": (mtp + "hnorm.weight", (hidden,)),
        "eh_proj.weight": (mtp + "eh_proj.weight", (hidden, 2 * hidden)),
        "shared_head.norm.weight": (mtp + "final_layernorm.weight", (hidden,)),
        "self_attn.q_a_proj.weight": (
            mtp + "transformer_layer.self_attention.linear_q_down_proj.weight",
            (m["q_lora_rank"], hidden),
        ),
        "self_attn.kv_a_layernorm.weight": (
            mtp + "transformer_layer.self_attention.kv_layernorm.weight",
            (m["kv_lora_rank"],),
        ),
        "mlp.gate.e_score_correction_bias": (mtp + "transformer_layer.mlp.router.expert_bias", (SIZES["experts"],)),
        "mlp.shared_experts.down_proj.weight": (
            mtp + "transformer_layer.mlp.shared_experts.linear_fc2.weight",
            (hidden, SIZES["moe_ffn"]),
        ),
    }
    for name, (key, shape) in own.items():
        assert same_bits(files[f"model.layers.2.{name}"], global_values(key, shape, torch.float32)), name
    experts = global_values(
        mtp + "transformer_layer.mlp.experts.experts.linear_fc2.weight",
        (SIZES["experts"], hidden, SIZES["moe_ffn"]),
        torch.float32,
    )
    assert same_bits(files["model.layers.2.mlp.experts.3.down_proj.weight"], experts[3])
    # The embedding and output head are shared; DeepSeek-V3 stores them again in the MTP layer.
    assert same_bits(files["model.layers.2.embed_tokens.weight"], files["model.embed_tokens.weight"])
    assert same_bits(files["model.layers.2.shared_head.head.weight"], files["lm_head.weight"])
    assert files["model.layers.2.embed_tokens.weight"].shape == (vocab, hidden)


def test_glm_mtp_module_has_deepseek_names_and_qkv_biases(merged):
    """GLM-4.5's MTP layer keeps DeepSeek-V3's names (its Hub checkpoint, vLLM's glm4_moe_mtp loader),
    with GLM's q/k/v biases and QK-norm in its decoder layer."""
    out = merged["glm4_moe_mtp"]
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (4, 1)
    files = load_safetensors_dir(out)
    hidden, mtp = SIZES["hidden"], "mtp.layers.0."
    assert same_bits(
        files["model.layers.4.eh_proj.weight"],
        global_values(mtp + "eh_proj.weight", (hidden, 2 * hidden), torch.float32),
    )
    qkv_rows = SIZES["kv_heads"] * (SIZES["heads"] // SIZES["kv_heads"] + 2) * SIZES["head_dim"]
    qkv_bias = global_values(mtp + "transformer_layer.self_attention.linear_qkv.bias", (qkv_rows,), torch.float32)
    head = SIZES["head_dim"]  # KV group 0 is [q heads 0, 1 | k_0 | v_0]
    assert same_bits(files["model.layers.4.self_attn.k_proj.bias"][:head], qkv_bias[2 * head : 3 * head])
    assert {f"model.layers.4.self_attn.{n}_norm.weight" for n in "qk"} <= files.keys()
    assert same_bits(files["model.layers.4.shared_head.head.weight"], files["lm_head.weight"])


@pytest.mark.parametrize("setting", ["num_nextn_predict_layers", "mtp_num_hidden_layers"])  # DeepSeek's, Qwen3.5's
def test_mtp_modules_the_config_does_not_declare_are_one_line(fresh_megatron, tmp_path, capsys, setting):
    """MTP trained on a model whose config.json says no MTP layers: refused, naming the setting it has."""
    sample = fresh_megatron("deepseek_v3_mtp")
    config_path = sample.role_dir / "huggingface" / "config.json"
    config = {k: v for k, v in json.loads(config_path.read_text()).items() if k != "num_nextn_predict_layers"}
    config_path.write_text(json.dumps({**config, setting: 0}))
    before = tree_digest(sample.role_dir)
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", tmp_path / "out", "--no-progress"
    )
    assert code != 0
    lines = error_lines(err)
    assert len(lines) == 1 and "config.json" in lines[0]
    assert f"1 multi-token-prediction module(s) (mtp.layers.*) but {setting} is 0" in lines[0]
    assert not (tmp_path / "out").exists()
    assert tree_digest(sample.role_dir) == before
