"""Model families as data: one ``Family`` record per Hugging Face architecture family.

A record says what differs between families and nothing else: its HF names (where the text model,
the vision tower, the MoE block and its experts are), its layout (fused QKV with biases, q/k norms,
multi-latent attention, experts, multi-token prediction, a vision tower), and, for the families
torchtitan ships, how torchtitan 0.3.0's ``state_dict_adapter.to_hf`` names each of its tensors.
The readers (``formats/megatron_names.py``, ``formats/torchtitan_names.py``) apply the records; the
sample writers (``sample_checkpoints/``) build their models from the same records. Adding an
architecture is one record here plus one test case (README, "Layout").

Megatron-Core's own tensor names are the same for every GPT model (``self_attention.linear_qkv``, ...):
their table is ``formats/megatron_names.py``'s, and a record fills in the HF side. This module imports
nothing but the standard library, so that torchtitan's own venv can read it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Torchtitan:
    """How torchtitan 0.3.0's ``state_dict_adapter.to_hf`` names a family's tensors (read from
    ``torchtitan/models/<model>/state_dict_adapter.py``)."""

    model: str  # torchtitan.models.<model>
    # torchtitan's name inside ``layers.<i>.`` -> the HF name inside ``model.layers.<i>.``; None: to_hf drops it.
    layer: Mapping[str, str | None]
    # Experts grouped on dimension 0 ([E, ...]) -> the HF name of expert ``{}``'s matrix: split per expert.
    grouped_experts: Mapping[str, str] = field(default_factory=dict)
    rotary_permuted: bool = False  # llama3: q/k rows stored in torchtitan's rotary order, permuted back


@dataclass(frozen=True)
class Family:
    """One HF architecture family: its names and its layout."""

    name: str
    model_type: str  # config.json "model_type"
    architectures: tuple[str, ...]  # config.json "architectures" it covers; the first is the causal LM
    # ---- HF names ----
    text_prefix: str = "model."  # embed_tokens, layers.<i>, norm
    vision_prefix: str | None = None  # vision-language models: the vision tower (Hub names, before transformers 5)
    moe_block: str = "mlp"  # the MoE block of a layer: router "<moe_block>.gate", experts "<moe_block>.experts.<e>."
    expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # an expert's gate, up, down
    shared_experts: str = "shared_experts"  # Qwen2-MoE says "shared_expert"
    # ---- layout ----
    qkv_bias: bool = False  # q/k/v projections carry biases
    qk_norm: bool = False  # per-head RMSNorm on q and k (self_attn.q_norm / k_norm)
    latent_attention: bool = False  # DeepSeek's multi-latent attention: compressed q and kv with their norms
    moe: bool = False  # routed experts
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    mtp: bool = False  # multi-token-prediction layers after the decoder's (num_nextn_predict_layers)
    megatron: bool = True  # the Megatron reader maps it
    torchtitan: Torchtitan | None = None  # torchtitan 0.3.0 ships a state_dict_adapter for it


# ---- torchtitan 0.3.0's names, per model ----------------------------------------------------------

_LLAMA3_LAYER = {
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
_TORCHTITAN_MOE = {
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_TORCHTITAN_GROUPED_EXPERTS = {
    "moe.routed_experts.inner_experts.w1_EFD": "mlp.experts.{}.gate_proj.weight",
    "moe.routed_experts.inner_experts.w3_EFD": "mlp.experts.{}.up_proj.weight",
    "moe.routed_experts.inner_experts.w2_EDF": "mlp.experts.{}.down_proj.weight",
}
TORCHTITAN_LLAMA3 = Torchtitan("llama3", MappingProxyType(_LLAMA3_LAYER), rotary_permuted=True)
TORCHTITAN_QWEN3 = Torchtitan(
    "qwen3",
    MappingProxyType(
        {
            **_LLAMA3_LAYER,
            **_TORCHTITAN_MOE,
            "attention.q_norm.weight": "self_attn.q_norm.weight",
            "attention.k_norm.weight": "self_attn.k_norm.weight",
            "moe.expert_bias_E": None,  # Qwen3's adapter has no HF name for the load-balancing bias: dropped
        }
    ),
    MappingProxyType(_TORCHTITAN_GROUPED_EXPERTS),
)
TORCHTITAN_DEEPSEEK_V3 = Torchtitan(
    "deepseek_v3",
    MappingProxyType(
        {
            **{k: v for k, v in _LLAMA3_LAYER.items() if "qkv_linear" not in k and ".wk." not in k and ".wv." not in k},
            **_TORCHTITAN_MOE,
            "attention.wq_a.weight": "self_attn.q_a_proj.weight",
            "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
            "attention.wq_b.weight": "self_attn.q_b_proj.weight",
            "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
            "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
            "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
            "moe.expert_bias_E": "mlp.gate.e_score_correction_bias",
            # Multi-token prediction: mtp_layers.<k> is HF layer num_hidden_layers + k.
            "enorm.weight": "enorm.weight",
            "hnorm.weight": "hnorm.weight",
            "eh_proj.weight": "eh_proj.weight",
            "mtp_norm.weight": "shared_head.norm.weight",
        }
    ),
    MappingProxyType(_TORCHTITAN_GROUPED_EXPERTS),
)
TORCHTITAN_GPT_OSS = Torchtitan(
    "gpt_oss",
    MappingProxyType(
        {
            **{
                k: v
                for k, v in _LLAMA3_LAYER.items()
                if k.startswith(("attention.qkv_linear", "attention.wo", "attention_n", "ffn"))
            },
            **{
                k.replace(".weight", ".bias"): v.replace(".weight", ".bias")
                for k, v in _LLAMA3_LAYER.items()
                if "qkv_linear" in k
            },
            "attention.wo.bias": "self_attn.o_proj.bias",
            "attention.sinks": "self_attn.sinks",
            "moe.router.gate.weight": "mlp.router.weight",
            "moe.router.gate.bias": "mlp.router.bias",
            "moe.expert_bias_E": None,  # not in gpt_oss's adapter map: to_hf drops it
        }
    ),
)

# ---- the families ---------------------------------------------------------------------------------

_VISION = "visual."  # the Hub's names; transformers 5 renames them to model.language_model.* / model.visual.* on load

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "llama", ("LlamaForCausalLM",), torchtitan=TORCHTITAN_LLAMA3),
        Family("mistral", "mistral", ("MistralForCausalLM",)),
        Family(
            "mixtral",
            "mixtral",
            ("MixtralForCausalLM",),
            moe_block="block_sparse_moe",
            expert_linears=("w1", "w3", "w2"),
            moe=True,
        ),
        Family("qwen2", "qwen2", ("Qwen2ForCausalLM",), qkv_bias=True),
        Family("qwen3", "qwen3", ("Qwen3ForCausalLM",), qk_norm=True, torchtitan=TORCHTITAN_QWEN3),
        Family(
            "qwen2_moe",
            "qwen2_moe",
            ("Qwen2MoeForCausalLM",),
            shared_experts="shared_expert",
            qkv_bias=True,
            moe=True,
            shared_expert_gate=True,
        ),
        Family("qwen3_moe", "qwen3_moe", ("Qwen3MoeForCausalLM",), qk_norm=True, moe=True, torchtitan=TORCHTITAN_QWEN3),
        Family(
            "deepseek_v3",
            "deepseek_v3",
            ("DeepseekV3ForCausalLM",),
            latent_attention=True,
            moe=True,
            mtp=True,
            torchtitan=TORCHTITAN_DEEPSEEK_V3,
        ),
        Family("qwen2_vl", "qwen2_vl", ("Qwen2VLForConditionalGeneration",), vision_prefix=_VISION, qkv_bias=True),
        Family(
            "qwen2_5_vl", "qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration",), vision_prefix=_VISION, qkv_bias=True
        ),
        # gpt-oss: attention sinks and biases; torchtitan's to_hf only (megatron-core 0.16 cannot build it on CPU).
        Family(
            "gpt_oss",
            "gpt_oss",
            ("GptOssForCausalLM",),
            qkv_bias=True,
            moe=True,
            megatron=False,
            torchtitan=TORCHTITAN_GPT_OSS,
        ),
    )
}


def by_architecture(architecture: str) -> Family | None:
    """The family whose config.json ``architectures`` entry this is."""
    return next((f for f in FAMILIES.values() if architecture in f.architectures), None)


def by_model_type(model_type: object) -> Family | None:
    """The family of a config.json ``model_type``."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)
