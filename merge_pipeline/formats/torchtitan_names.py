"""torchtitan model names to HF names, as each family's ``state_dict_adapter.to_hf`` (torchtitan 0.3.0).

Read from torchtitan's own adapters (``torchtitan/models/<family>/state_dict_adapter.py``); the family
is chosen from the HF config's ``model_type``. What each ``to_hf`` does, streamed as byte ranges:

- llama3 (``llama``): q/k rows permuted back to HF's rotary layout (each HF row is one stored row).
- qwen3 / qwen3_moe, deepseek_v3, gpt_oss: names only; qwen3 and gpt_oss keep HF's rotary layout.
- MoE (qwen3, deepseek_v3): grouped experts ``w1_EFD`` / ``w3_EFD`` / ``w2_EDF`` (experts first) split
  into ``mlp.experts.<e>.gate/up/down_proj`` (``_split_experts_weights``: expert ``e`` is index ``e``).
- deepseek_v3: MLA names, shared experts, ``expert_bias_E`` as ``mlp.gate.e_score_correction_bias``,
  MTP layers ``mtp_layers.<k>`` as HF layer ``num_hidden_layers + k``.
- Tied embeddings (``tie_word_embeddings``): ``lm_head`` is dropped, as ``to_hf`` does.

The older torchtitan Llama names (``attention.wq``, ``output``) keep working. Entries an adapter drops
(Qwen3's router ``expert_bias_E``) are dropped too; a name no adapter maps is one error naming it.
"""

from __future__ import annotations

import re

# Per family: torchtitan's name inside a layer -> HF name inside ``model.layers.<i>.``.
_LLAMA3 = {
    "attention.qkv_linear.wq.weight": "self_attn.q_proj.weight",
    "attention.qkv_linear.wk.weight": "self_attn.k_proj.weight",
    "attention.qkv_linear.wv.weight": "self_attn.v_proj.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",  # torchtitan before qkv_linear (older releases)
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
# Grouped experts (experts on dimension 0) -> the HF name of one expert's matrix.
GROUPED_EXPERTS = {
    "moe.routed_experts.inner_experts.w1_EFD": "mlp.experts.{}.gate_proj.weight",
    "moe.routed_experts.inner_experts.w3_EFD": "mlp.experts.{}.up_proj.weight",
    "moe.routed_experts.inner_experts.w2_EDF": "mlp.experts.{}.down_proj.weight",
}
_QWEN3 = {
    **_LLAMA3,
    **_MOE,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "moe.expert_bias_E": None,  # Qwen3's adapter has no HF name for the load-balancing bias: dropped
}
_DEEPSEEK_V3 = {
    **{k: v for k, v in _LLAMA3.items() if "qkv_linear" not in k and ".wk." not in k and ".wv." not in k},
    **_MOE,
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "moe.expert_bias_E": "mlp.gate.e_score_correction_bias",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "mtp_norm.weight": "shared_head.norm.weight",
}
_GPT_OSS = {
    **{
        k: v for k, v in _LLAMA3.items() if k.startswith(("attention.qkv_linear", "attention.wo", "attention_n", "ffn"))
    },
    **{k.replace(".weight", ".bias"): v.replace(".weight", ".bias") for k, v in _LLAMA3.items() if "qkv_linear" in k},
    "attention.wo.bias": "self_attn.o_proj.bias",
    "attention.sinks": "self_attn.sinks",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.expert_bias_E": None,  # not in gpt_oss's adapter map: to_hf drops it
}
# HF model_type -> (family, its layer table, whether q/k rows are permuted).
FAMILIES = {
    "llama": ("llama3", _LLAMA3, True),
    "qwen3": ("qwen3", _QWEN3, False),
    "qwen3_moe": ("qwen3", _QWEN3, False),
    "deepseek_v3": ("deepseek_v3", _DEEPSEEK_V3, False),
    "gpt_oss": ("gpt_oss", _GPT_OSS, False),
}
TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
HEADS = ("lm_head.weight", "output.weight")  # torchtitan 0.3 and older


def hf_layer_name(key: str, table: dict[str, str | None], num_hidden_layers: int) -> tuple[str | None, str] | None:
    """(HF name or None to drop, the torchtitan name inside the layer) for ``layers.<i>.*`` /
    ``mtp_layers.<k>.*``; None when ``key`` is not a layer entry the family maps."""
    match = re.fullmatch(r"(layers|mtp_layers)\.(\d+)\.(.+)", key)
    if match is None or match[3] not in table and match[3] not in GROUPED_EXPERTS:
        return None
    layer = int(match[2]) + (num_hidden_layers if match[1] == "mtp_layers" else 0)
    hf = table.get(match[3]) if match[3] in table else GROUPED_EXPERTS[match[3]]
    return (None if hf is None else f"model.layers.{layer}.{hf}"), match[3]
