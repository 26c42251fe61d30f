"""Model families as data: one ``Family`` record per Hugging Face architecture family.

A record says what differs between families and nothing else: its HF names (where the text model,
the vision tower, the MoE block and its experts are), its layout (fused QKV with biases, q/k norms,
multi-latent attention, experts, multi-token prediction, a vision tower), and, for the families
torchtitan ships, how torchtitan 0.3.0's ``state_dict_adapter.to_hf`` names each of its tensors.
The readers (``formats/megatron/names.py``, ``formats/dcp/torchtitan_names.py``) apply the records; the
sample writers (``merge_pipeline_samples/``) build their models from the same records. Adding an
architecture is one record here plus one test case (README, "Layout").

Megatron-Core's own tensor names are the same for every GPT model (``self_attention.linear_qkv``, ...):
their table is ``formats/megatron/names.py``'s, and a record fills in the HF side. This module imports
nothing but the standard library, so that torchtitan's own venv can read it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Torchtitan:
    """How torchtitan 0.3.0's ``state_dict_adapter.to_hf`` names a family's tensors (read from
    ``torchtitan/models/<model>/state_dict_adapter.py``)."""

    model: str  # torchtitan.models.<model>
    # torchtitan's name inside ``layers.<i>.`` -> the HF name inside ``<text_prefix>layers.<i>.``; None: to_hf drops it.
    layer: Mapping[str, str | None]
    # Experts grouped on dimension 0 ([E, ...]) -> the HF name of expert ``{}``'s matrix: split per expert.
    grouped_experts: Mapping[str, str] = field(default_factory=dict)
    # Experts grouped on dimension 0 ([E, out, in]) -> the HF name of the same group with each expert's
    # matrix transposed ([E, in, out]: gpt-oss's layout, formats/expert_matrices.py).
    transposed_experts: Mapping[str, str] = field(default_factory=dict)
    rotary_permuted: bool = False  # llama3: q/k rows stored in torchtitan's rotary order, permuted back
    text_prefix: str = "model."  # in front of embed_tokens, layers.<i>, norm
    # An HF tensor of a layer that to_hf concatenates from several torchtitan tensors (rows, in order).
    fused_layer: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Vision tower: torchtitan name ("{}": the block) -> HF name; fused ones: HF name -> torchtitan names.
    vision: Mapping[str, str] = field(default_factory=dict)
    fused_vision: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # The patch embedding torchtitan keeps as a Linear [out, C * kernel] and to_hf reshapes into HF's
    # Conv weight [out, C, *kernel]: (torchtitan name, HF name, the vision_config sizes of the kernel).
    patch_embed: tuple[str, str, tuple[str, ...]] | None = None
    # Put in front of every language-model HF name (lm_head too) when a vision tower is saved beside it.
    nested_with_vision: str = ""


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
    expert_linears: tuple[str, str, str] = (
        "gate_proj",
        "up_proj",
        "down_proj",
    )  # an expert's gate, up, down
    shared_experts: str = "shared_experts"  # Qwen2-MoE says "shared_expert"
    # ---- layout ----
    qkv_bias: bool = False  # q/k/v projections carry biases
    qk_norm: bool = False  # per-head RMSNorm on q and k (self_attn.q_norm / k_norm)
    latent_attention: bool = False  # DeepSeek's multi-latent attention: compressed q and kv with their norms
    moe: bool = False  # routed experts
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    mtp: bool = False  # multi-token-prediction layers after the decoder's (num_nextn_predict_layers)
    router: str = "gate"  # the router inside the MoE block (gpt-oss: "router")
    attention_sinks: bool = False  # a learned logit per head in the softmax (self_attn.sinks)
    # Each layer's experts as one tensor per kind in HF's transposed layout, gate/up interleaved (gpt-oss).
    grouped_experts: bool = False
    megatron: bool = True  # the Megatron reader maps it
    from_bridge: bool = False  # no record here: the Megatron reader takes every name from Megatron-Bridge's table
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
            # torchtitan 0.3.0's to_hf maps "mlp1_bias" etc., which the model never saves, so it drops every
            # expert tensor; these are the names transformers' GptOssForCausalLM loads (the biases as stored).
            "moe.routed_experts.inner_experts.mlp1_bias_EG": "mlp.experts.gate_up_proj_bias",
            "moe.routed_experts.inner_experts.mlp2_bias_ED": "mlp.experts.down_proj_bias",
        }
    ),
    # Its rows already interleave gate and up (its swiglu takes [..., ::2] and [..., 1::2], as HF's does).
    transposed_experts=MappingProxyType(
        {
            "moe.routed_experts.inner_experts.mlp1_weight_EGD": "mlp.experts.gate_up_proj",
            "moe.routed_experts.inner_experts.mlp2_weight_EDF": "mlp.experts.down_proj",
        }
    ),
)


def _with_biases(modules: dict[str, str]) -> dict[str, str]:
    """Each module's weight and bias: torchtitan module -> HF module."""
    return {f"{tt}.{kind}": f"{hf}.{kind}" for tt, hf in modules.items() for kind in ("weight", "bias")}


def _fused_vision_qkv(hf: str) -> MappingProxyType:
    """A vision block's q/k/v (torchtitan: ``attn.wq/wk/wv`` of block ``{}``) concatenated into HF's ``hf``."""
    return MappingProxyType(
        {
            f"{hf}.{kind}": tuple(f"vision_encoder.layers.{{}}.attn.{w}.{kind}" for w in ("wq", "wk", "wv"))
            for kind in ("weight", "bias")
        }
    )


_QWEN3_5_VISION = {
    "vision_encoder.patch_embed.bias": "model.visual.patch_embed.proj.bias",
    "vision_encoder.pos_embed": "model.visual.pos_embed.weight",
    **_with_biases(
        {
            f"vision_encoder.layers.{{}}.{name}": f"model.visual.blocks.{{}}.{name}"
            for name in ("norm1", "norm2", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")
        }
    ),
    **_with_biases(
        {
            f"vision_encoder.merger.{name}": f"model.visual.merger.{name}"
            for name in ("norm", "linear_fc1", "linear_fc2")
        }
    ),
}
TORCHTITAN_QWEN3_5 = Torchtitan(
    "qwen3_5",
    MappingProxyType(
        {
            "attn.wq.weight": "self_attn.q_proj.weight",
            "attn.wk.weight": "self_attn.k_proj.weight",
            "attn.wv.weight": "self_attn.v_proj.weight",
            "attn.wo.weight": "self_attn.o_proj.weight",
            "attn.q_norm.weight": "self_attn.q_norm.weight",
            "attn.k_norm.weight": "self_attn.k_norm.weight",
            # Gated DeltaNet (linear attention) layers
            "attn.in_proj_z.weight": "linear_attn.in_proj_z.weight",
            "attn.in_proj_a.weight": "linear_attn.in_proj_a.weight",
            "attn.in_proj_b.weight": "linear_attn.in_proj_b.weight",
            "attn.A_log": "linear_attn.A_log",
            "attn.dt_bias": "linear_attn.dt_bias",
            "attn.norm.weight": "linear_attn.norm.weight",
            "attn.out_proj.weight": "linear_attn.out_proj.weight",
            **{k: v for k, v in _LLAMA3_LAYER.items() if k.startswith(("feed_forward", "attention_norm", "ffn_norm"))},
            "moe.router.gate.weight": "mlp.gate.weight",
            "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
            "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
            "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
            "moe.shared_experts.gate.weight": "mlp.shared_expert_gate.weight",
            "moe.expert_bias_E": None,  # not in qwen3_5's adapter map: to_hf drops it
        }
    ),
    text_prefix="model.language_model.",
    fused_layer=MappingProxyType(
        {
            "linear_attn.in_proj_qkv.weight": (
                "attn.in_proj_q.weight",
                "attn.in_proj_k.weight",
                "attn.in_proj_v.weight",
            ),
            "linear_attn.conv1d.weight": (
                "attn.conv_q.weight",
                "attn.conv_k.weight",
                "attn.conv_v.weight",
            ),
        }
    ),
    # Its to_hf writes them transposed and fused (mlp.experts.gate_up_proj [E, D, 2F]), a layout transformers 5's
    # Qwen3_5Moe does not load (its gate_up_proj is [E, 2F, D]); split per expert, transformers loads and fuses them.
    grouped_experts=MappingProxyType(_TORCHTITAN_GROUPED_EXPERTS),
    vision=MappingProxyType(_QWEN3_5_VISION),
    fused_vision=_fused_vision_qkv("model.visual.blocks.{}.attn.qkv"),
    patch_embed=(
        "vision_encoder.patch_embed.weight",
        "model.visual.patch_embed.proj.weight",
        ("temporal_patch_size", "patch_size", "patch_size"),
    ),
)
TORCHTITAN_KIMI_K2_7 = dataclasses.replace(
    TORCHTITAN_DEEPSEEK_V3,
    model="kimi_k2_7",
    vision=MappingProxyType(
        {
            "vision_encoder.patch_embed.bias": "vision_tower.patch_embed.proj.bias",
            "vision_encoder.pos_embed": "vision_tower.patch_embed.pos_emb.weight",
            **_with_biases(
                {
                    "vision_encoder.layers.{}.norm1": "vision_tower.encoder.blocks.{}.norm0",
                    "vision_encoder.layers.{}.norm2": "vision_tower.encoder.blocks.{}.norm1",
                    "vision_encoder.layers.{}.attn.proj": "vision_tower.encoder.blocks.{}.wo",
                    "vision_encoder.layers.{}.mlp.linear_fc1": "vision_tower.encoder.blocks.{}.mlp.fc0",
                    "vision_encoder.layers.{}.mlp.linear_fc2": "vision_tower.encoder.blocks.{}.mlp.fc1",
                    "vision_encoder.final_norm": "vision_tower.encoder.final_layernorm",
                    "vision_encoder.projector.pre_norm": "mm_projector.pre_norm",
                    # Kimi-K2.5's spelling; Kimi-VL's (multi_modal_projector.linear_1/2) needs the adapter's HF index.
                    "vision_encoder.projector.linear_1": "mm_projector.proj.0",
                    "vision_encoder.projector.linear_2": "mm_projector.proj.2",
                }
            ),
        }
    ),
    fused_vision=_fused_vision_qkv("vision_tower.encoder.blocks.{}.wqkv"),
    patch_embed=(
        "vision_encoder.patch_embed.weight",
        "vision_tower.patch_embed.proj.weight",
        ("patch_size", "patch_size"),
    ),
    nested_with_vision="language_model.",
)

# ---- the families ---------------------------------------------------------------------------------

_VISION = "visual."  # the Hub's names; transformers 5 renames them to model.language_model.* / model.visual.* on load

# Hybrid linear attention (Gated DeltaNet) with a vision tower; torchtitan's to_hf (its Megatron shards are read
# through Megatron-Bridge's table: MEGATRON_PROVEN). The MoE model is the same family plus its experts.
_QWEN3_5 = Family(
    "qwen3_5",
    "qwen3_5",
    ("Qwen3_5ForConditionalGeneration",),
    text_prefix="model.language_model.",
    vision_prefix="model.visual.",
    qk_norm=True,
    megatron=False,
    torchtitan=TORCHTITAN_QWEN3_5,
)
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
        Family(
            "qwen3",
            "qwen3",
            ("Qwen3ForCausalLM",),
            qk_norm=True,
            torchtitan=TORCHTITAN_QWEN3,
        ),
        Family(
            "qwen2_moe",
            "qwen2_moe",
            ("Qwen2MoeForCausalLM",),
            shared_experts="shared_expert",
            qkv_bias=True,
            moe=True,
            shared_expert_gate=True,
        ),
        Family(
            "qwen3_moe",
            "qwen3_moe",
            ("Qwen3MoeForCausalLM",),
            qk_norm=True,
            moe=True,
            torchtitan=TORCHTITAN_QWEN3,
        ),
        Family(
            "deepseek_v3",
            "deepseek_v3",
            ("DeepseekV3ForCausalLM",),
            latent_attention=True,
            moe=True,
            mtp=True,
            torchtitan=TORCHTITAN_DEEPSEEK_V3,
        ),
        Family(
            "qwen2_vl",
            "qwen2_vl",
            ("Qwen2VLForConditionalGeneration",),
            vision_prefix=_VISION,
            qkv_bias=True,
        ),
        Family(
            "qwen2_5_vl",
            "qwen2_5_vl",
            ("Qwen2_5_VLForConditionalGeneration",),
            vision_prefix=_VISION,
            qkv_bias=True,
        ),
        _QWEN3_5,
        dataclasses.replace(
            _QWEN3_5,
            name="qwen3_5_moe",
            model_type="qwen3_5_moe",
            architectures=("Qwen3_5MoeForConditionalGeneration",),
            shared_experts="shared_expert",
            moe=True,
            shared_expert_gate=True,
        ),
        # Kimi-K2.5 (torchtitan's kimi_k2_7): the DeepSeek-V3 language model beside a MoonViT vision tower.
        Family(
            "kimi_k25",
            "kimi_k25",
            ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration"),
            text_prefix="language_model.model.",
            vision_prefix="vision_tower.",
            latent_attention=True,
            moe=True,
            megatron=False,
            torchtitan=TORCHTITAN_KIMI_K2_7,
        ),
        # GLM-4.5 / GLM-4.5-Air: q/k/v biases, optional QK-norm, partial rotary (which moves no tensor),
        # dense then MoE layers, sigmoid router with expert bias, shared experts, DeepSeek-style MTP layers.
        Family(
            "glm4_moe",
            "glm4_moe",
            ("Glm4MoeForCausalLM",),
            qkv_bias=True,
            qk_norm=True,
            moe=True,
            mtp=True,
        ),
        # gpt-oss: attention sinks, biases everywhere, every layer MoE with a biased router and grouped
        # experts that HF keeps transposed, gate and up interleaved.
        Family(
            "gpt_oss",
            "gpt_oss",
            ("GptOssForCausalLM",),
            qkv_bias=True,
            moe=True,
            router="router",
            attention_sinks=True,
            grouped_experts=True,
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


# ---- Megatron shards this reader refuses ----------------------------------------------------------

# Architectures verl trains with Megatron whose shards are not mapped to HF names here, and why:
# megatron-core 0.16 cannot build them on CPU (so no mapping could be proven against its own forward).
# Refused at plan time.
_LLAMA4 = (
    "Llama 4: megatron-core 0.16 has no chunked attention (attention_chunk_size) and no attention-temperature "
    "tuning for its NoPE layers, so it cannot build the model and no mapping could be proven against its forward"
)
_NO_TRANSFORMERS = "transformers 5.12.1 does not ship it: no tiny model to build it from or to load it"
# Megatron-Bridge architectures (merge_pipeline/bridge_mappings.json) no family maps; the reasons are what
# merge_pipeline_samples/megatron_bridge_archs.py --each found (its failed.txt lines, quoted or summed up).
BRIDGE_REFUSED: Mapping[str, str] = {
    "BailingMoeV2ForCausalLM": _NO_TRANSFORMERS,
    "DeciLMForCausalLM": _NO_TRANSFORMERS,
    "KimiK2ForCausalLM": _NO_TRANSFORMERS,
    "MiMoV2FlashForCausalLM": _NO_TRANSFORMERS,
    "SarvamMLAForCausalLM": _NO_TRANSFORMERS,
    "SarvamMoEForCausalLM": _NO_TRANSFORMERS,
    "Step3p5ForCausalLM": _NO_TRANSFORMERS,
    "KimiK25ForConditionalGeneration": _NO_TRANSFORMERS,
    "NemotronH_Nano_Omni_Reasoning_V3": _NO_TRANSFORMERS,
    "NemotronH_Nano_VL_V2": _NO_TRANSFORMERS,
    "NemotronLabsDiffusionModel": _NO_TRANSFORMERS,
    "Qwen3ASRForConditionalGeneration": _NO_TRANSFORMERS,
    "Step3p7ForConditionalGeneration": _NO_TRANSFORMERS,
    "DeepseekV4ForCausalLM": (
        "not built here: megatron-core 0.18.2 has no attention variant 'dsv4_hybrid', which DeepSeek-V4's bridge "
        "asks for (ValueError: Invalid experimental attention variant: dsv4_hybrid)"
    ),
    "ExaoneMoEForCausalLM": (
        "transformers 5.12.1 ships this bridge's architecture only as ExaoneMoeForCausalLM (proven): no model "
        "class under this spelling to build or load"
    ),
}
MEGATRON_REFUSED: Mapping[str, str] = MappingProxyType(
    {
        **BRIDGE_REFUSED,
        "MiMoForCausalLM": "MiMo: remote code that transformers 5 does not ship, with MTP layers of its own",
        "Llama4ForConditionalGeneration": _LLAMA4,
        "Llama4ForCausalLM": _LLAMA4,
    }
)

# ---- Megatron-Bridge's architectures, accounted for -----------------------------------------------

# Architectures Megatron-Bridge registers whose Megatron shards, built by the bridge itself on CPU and saved as
# verl saves them, merge bit for bit into the bridge's own export_hf_weights and load in transformers with
# nothing missing (merge_pipeline_tests/formats/megatron/test_bridge_architectures.py): the fixture's layout.
_EP = "TP=2, EP=2"
MEGATRON_PROVEN: Mapping[str, str] = MappingProxyType(
    {
        "LlamaForCausalLM": "TP=2",
        "MistralForCausalLM": "TP=2",
        "Qwen2ForCausalLM": "TP=2",
        "Qwen3ForCausalLM": "TP=2",
        "Qwen3MoeForCausalLM": _EP,
        "GptOssForCausalLM": _EP,
        "HYV3ForCausalLM": _EP,  # no family record: every name from Megatron-Bridge's table
        "DeepseekV2ForCausalLM": _EP,  # likewise
        "Glm4MoeLiteForCausalLM": _EP,  # likewise
        "DeepseekV3ForCausalLM": _EP,
        # Built through the TransformerEngine stand-in (merge_pipeline_samples/te_stand_in/): the bridge's own spec.
        "OlmoeForCausalLM": _EP,
        "Ernie4_5_MoeForCausalLM": _EP,
        "ExaoneMoeForCausalLM": _EP,
        "NemotronForCausalLM": "TP=2",
        "GemmaForCausalLM": "TP=2",
        "Gemma2ForCausalLM": "TP=2",
        "Gemma3ForCausalLM": "TP=2",
        "Gemma3ForConditionalGeneration": "TP=2",
        "Gemma4ForCausalLM": "TP=2",  # dense (transformers' default config), the bridge's dense registry
        "Gemma4ForConditionalGeneration": "TP=2",  # likewise, with vision and audio towers
        "Exaone4ForCausalLM": "TP=2",
        "GlmMoeDsaForCausalLM": _EP,
        "Qwen3VLForConditionalGeneration": "TP=2",
        "Qwen3VLMoeForConditionalGeneration": _EP,
        "Mistral3ForConditionalGeneration": "TP=2",
        "MiniMaxM2ForCausalLM": "TP=1, EP=2",  # its bridge loads q/k norms through CUDA at TP > 1
        "Glm4vMoeForConditionalGeneration": _EP,
        "MiniMaxM3SparseForConditionalGeneration": _EP,
        "Exaone4_5_ForConditionalGeneration": "TP=2",
        "Qwen2_5_VLForConditionalGeneration": "TP=2",  # also a family record (megatron-core's own vision model)
        "Glm4MoeForCausalLM": _EP,  # also a family record: its names equal the bridge's (test_bridge_families.py)
        # Gated DeltaNet (flash-linear-attention in .venv-bridge): a linear-attention layer, then a full-attention one.
        "Qwen3NextForCausalLM": _EP,
        "Qwen3_5ForCausalLM": "TP=2",
        "Qwen3_5MoeForCausalLM": _EP,
        "Qwen3_5ForConditionalGeneration": "TP=2",  # also a family record (torchtitan's names only)
        "Qwen3_5MoeForConditionalGeneration": _EP,  # likewise
        # Mamba hybrids, built through the mamba-ssm stand-in (merge_pipeline_samples/mamba_stand_in/).
        "NemotronHForCausalLM": _EP,  # mamba, MoE, attention and MLP layers (transformers' default pattern)
        "FalconH1ForCausalLM": "TP=1",  # its bridge's block cannot save at TP > 1: two data-parallel ranks
        "Qwen2_5OmniForConditionalGeneration": "TP=2",  # the thinker (no talker: enable_audio_output false)
        "Qwen3OmniMoeForConditionalGeneration": _EP,  # likewise
        "Qwen2AudioForConditionalGeneration": "TP=2",
        "Ernie4_5_VLMoeForConditionalGeneration": _EP,  # text and vision expert pools, both EP=2
    }
)
# Other forms of a proven architecture, each with a fixture of its own (megatron_bridge_archs.py's
# <architecture>+<variant>) and the layout it was saved in: the bridge keeps a registry per form.
BRIDGE_VARIANTS: Mapping[str, str] = MappingProxyType(
    {
        "Gemma4ForCausalLM+moe": _EP,  # enable_moe_block, K = V full attention: the bridge's MoE registry
        "Gemma4ForCausalLM+kv_shared": "TP=2",  # dense, its last layers reusing earlier ones' K, V (E2B, E4B)
        "Gemma4ForConditionalGeneration+moe": _EP,  # the MoE one with its vision and audio towers
    }
)
# Architectures whose transformers 5 model holds each layer's experts as two stacked tensors, experts.gate_up_proj
# [experts, 2 x moe_intermediate, hidden] and experts.down_proj [experts, hidden, moe_intermediate]: the bridge's
# table names one tensor per expert, its export stacks them (Megatron's fc1 / fc2 of each expert as stored).
BRIDGE_STACKED_EXPERTS = frozenset({"Qwen3VLMoeForConditionalGeneration"})
