"""A verl Megatron checkpoint written through Megatron-Bridge 0.6 itself: run with the bridge venv's python.

    .venv-bridge/bin/python merge_pipeline_samples/megatron_bridge_save.py OUT

``scripts/setup_bridge.sh`` builds that venv (megatron-core 0.18 and Megatron-Bridge 0.6, whose
wheels say Python 3.12, installed on 3.11 without their dependencies), so this file imports only
torch, transformers, safetensors, megatron-core and Megatron-Bridge. Rank 0 saves a small transformers
model (``OUT/<family>/hf/``); two gloo ranks load it with ``AutoBridge.from_hf_pretrained`` and the
bridge's own model provider (tensor parallel 2, megatron-core's local layer spec) and save what verl's
``MegatronCheckpointManager`` saves with the bridge and ``use_dist_checkpointing=True`` into
``OUT/<family>/actor/``: ``model/dist_ckpt/`` (megatron-core ``dist_checkpointing.save`` of the model's
``sharded_state_dict``, as verl's ``save_dist_checkpointing``), ``model/huggingface/`` (the HF config, then the bridge's
``save_hf_weights``) and ``transformer_config.json``. Rank 0 writes what the bridge's
``export_hf_weights`` gives as ``OUT/<family>/expected/model.safetensors``.

``_save`` is the one writer: ``megatron_bridge_archs.py`` calls it for every architecture with the bridge's own
layer spec (TransformerEngine's, built by the CPU stand-in ``scripts/setup_bridge.sh`` installs in that venv from
``merge_pipeline_samples/te_stand_in/``), this file's families with megatron-core's local spec: the two sets of
names verl saves with and without TransformerEngine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script, its own folder comes first on the path, where megatron.py would hide megatron-core:
# the repository's root takes its place.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from merge_pipeline_samples.gloo_ranks import spawn_gloo_ranks  # noqa: E402  (after its path)

FAMILIES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LORA_FAMILY = "llama"  # also saved with the bridge's LoRA, into OUT/llama/lora/
_CUDA_FUSIONS = (
    "apply_rope_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "gradient_accumulation_fusion",
    "cross_entropy_loss_fusion",
)


def _import_bridge():
    from megatron.bridge import AutoBridge

    return AutoBridge


def _patch_for_cpu() -> None:
    # dist_checkpointing and the model provider call these; there is no CUDA here.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    # Modules that initialise under the model-parallel RNG tracker (the vision towers) fork CUDA generators:
    # megatron-core's inference tracker forks none. Every weight is then loaded from the HF model anyway.
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


# Small sizes under every name the architectures' config classes use for them.
_SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
_MOE_SIZES = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_k=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    n_group=1,  # DeepSeek's grouped routing: one group
    topk_group=1,
    num_nextn_predict_layers=0,  # transformers builds no MTP layers, which the bridge would look for
    # multi-latent attention
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)
# Gated DeltaNet (Qwen3-Next, Qwen3.5): small linear-attention heads, more value heads than key heads (two per key
# head, as released), and one full-attention layer after the linear one, so both kinds of layer are saved. Their
# releases have one multi-token-prediction layer (mtp_num_hidden_layers, which the bridge builds and verl saves):
# set on the config after it is built (_small), its weights written beside the model's (_add_mtp_weights).
_GATED_DELTANET_SIZES = dict(
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    shared_expert_intermediate_size=32,
)
# A MoE Gemma 4 (the bridge's default registry; as Gemma 4 26B-A4B: K = V on its full-attention layers, no per-layer
# embeddings), with or without its towers.
_GEMMA4_MOE = dict(
    tie_word_embeddings=True,
    hidden_size_per_layer_input=0,
    global_head_dim=32,
    num_global_key_value_heads=1,
    enable_moe_block=True,
    attention_k_eq_v=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
)
# Sizes one architecture's bridge needs: OLMoE's bridge maps its q/k norms (HF: over all heads of q, of k) onto
# megatron-core's over the hidden size, as in OLMoE's released configs, where every head has its own keys.
# The Gemma and Exaone 4 bridges map no output layer (Gemma's share it whatever the config says): their tiny
# models tie it to the embedding, as every Gemma release and Exaone 4.0's small one do.
_ARCHITECTURE_SIZES = {
    **dict.fromkeys(
        (
            "GemmaForCausalLM",
            "Gemma2ForCausalLM",
            "Gemma3ForCausalLM",
            "Gemma3ForConditionalGeneration",
        ),
        dict(tie_word_embeddings=True),
    ),
    # Gemma 4 (dense, as transformers' default config): its per-layer embedding at the small vocabulary, and its
    # full-attention layers' heads small too; tied like every Gemma release (its bridge maps no output layer).
    **dict.fromkeys(
        ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
        dict(
            tie_word_embeddings=True,
            vocab_size_per_layer_input=256,
            hidden_size_per_layer_input=16,
            global_head_dim=32,
        ),
    ),
    # The MoE Gemma 4: a fixture of its own, ``Gemma4ForCausalLM+moe``.
    "Gemma4ForCausalLM+moe": _GEMMA4_MOE,
    # ERNIE 4.5-VL's two expert pools (text, vision): an intermediate size each; its first layer dense, as released;
    # its multimodal rotary sections cover the tiny heads' rotary frequencies.
    "Ernie4_5_VLMoeForConditionalGeneration": dict(
        moe_intermediate_size=[_MOE_SIZES["moe_intermediate_size"], 16],
        moe_num_shared_experts=1,
        mlp_layer_types=["dense", "sparse"],
        tie_word_embeddings=True,  # as released (its bridge maps no output layer)
        rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[3, 3, 2]),
    ),
    # A MoE Gemma 4 with its towers (as Gemma 4 26B-A4B's vision, and an audio tower the bridge maps too).
    "Gemma4ForConditionalGeneration+moe": _GEMMA4_MOE,
    # A dense Gemma 4 whose last layers reuse earlier layers' keys and values (num_kv_shared_layers, as Gemma 4 E2B
    # and E4B): they have no K, V or K norm of their own.
    "Gemma4ForCausalLM+kv_shared": dict(
        tie_word_embeddings=True,
        vocab_size_per_layer_input=256,
        hidden_size_per_layer_input=16,
        global_head_dim=32,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        num_global_key_value_heads=2,  # the bridge sizes a shared layer's zero K, V by it (None: TypeError)
    ),
    "OlmoeForCausalLM": dict(num_key_value_heads=4),
    "Exaone4ForCausalLM": dict(tie_word_embeddings=True),
    # GLM-5's bridge reads the indexer's rotary layout, a name transformers 5.12.1's GlmMoeDsaConfig lacks; it
    # orders the indexer's rotary channels in the forward only, and no forward runs here.
    "GlmMoeDsaForCausalLM": dict(indexer_rope_interleave=False),
    # MiniMax-M2's experts are intermediate_size wide in transformers; its bridge reads moe_intermediate_size first.
    "MiniMaxM2ForCausalLM": dict(moe_intermediate_size=_SIZES["intermediate_size"]),
    # DeepSeek-V4's bridge reads its compressed attention's YaRN values (factor, original context), which the
    # default config's rotary parameters lack.
    "DeepseekV4ForCausalLM": dict(
        rope_parameters=dict(
            main=dict(rope_type="default", rope_theta=10000.0),
            compress=dict(rope_type="yarn", rope_theta=160000.0, factor=16.0, original_max_position_embeddings=256),
        )
    ),
    # GLM-4.5V's bridge reads the text model's use_qk_norm and head_dim (GLM-4.5's names), which
    # Glm4vMoeTextConfig lacks: GLM-4.5V has no q/k norm, and its heads are hidden_size / heads wide.
    # Its multimodal rotary sections (mrope_section) cover the tiny heads' rotary frequencies, as the released ones
    # cover theirs: transformers' default sections are for 128-wide heads, and its forward splits by them.
    "Glm4vMoeForConditionalGeneration": dict(
        use_qk_norm=False,
        head_dim=16,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 2]
        ),
    ),
    **dict.fromkeys(
        (
            "Qwen2_5_VLForConditionalGeneration",
            "Qwen2_5OmniForConditionalGeneration",
            "Qwen3OmniMoeForConditionalGeneration",
        ),
        dict(rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3])),
    ),
    # Mistral 3's bridge builds Ministral 3's attention, whose Llama 4 query scaling reads these rotary values
    # (they scale the forward only).
    "Mistral3ForConditionalGeneration": dict(
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1000000.0,
            factor=1.0,
            original_max_position_embeddings=256,
            llama_4_scaling_beta=0.1,
        )
    ),
    # Mamba layers (megatron-core's MambaMixer through the mamba-ssm stand-in): small heads and state, two groups so
    # that each TP rank holds one. Nemotron-H: transformers' default layer pattern (mamba, moe, attention, mlp), its
    # shared expert small too. Falcon-H1: the gated RMSNorm after the gate, as the released models (megatron-core
    # builds no other: ``assert not self.norm_before_gate``).
    "NemotronHForCausalLM": dict(
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=8,
        chunk_size=8,
        moe_shared_expert_intermediate_size=32,
    ),
    "FalconH1ForCausalLM": dict(
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_ssm=64,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_chunk_size=8,
        mamba_rms_norm=True,
        mamba_norm_before_gate=False,
    ),
}
# Qwen2.5-Omni's speaker table (spk_dict.pt), none here: the tiny model speaks no audio (enable_audio_output false).
_SPEAKERS = {"Qwen2_5OmniForConditionalGeneration": "spk_dict.pt"}
# MiniMax-M2's bridge loads its q/k norms at TP > 1 through a CUDA device (``torch.device("cuda", ...)`` in
# minimax_m2_bridge.py); at TP=1 it stays on the tensor's device: saved with its experts split over both ranks.
# Falcon-H1's block (the bridge's FalconH1Stack.sharded_state_dict) saves its final norm without the TP group, so
# both TP ranks claim the one main replica and dist_checkpointing.save refuses at TP > 1 ("Invalid access pattern"):
# saved at TP=1 on two data-parallel ranks.
_TENSOR_PARALLEL = {"MiniMaxM2ForCausalLM": 1, "FalconH1ForCausalLM": 1}


# A vision (or audio) tower's small sizes under the names their config classes use (each where the class has
# it); Qwen3-VL's deepstack layers index its depth.
_TOWER_SIZES = dict(
    hidden_size=32,
    depth=2,
    num_hidden_layers=2,
    num_heads=2,
    num_attention_heads=2,
    num_key_value_heads=2,  # a tower with grouped keys (Exaone 4.5's): one key head per query head
    intermediate_size=64,
    out_hidden_size=_SIZES["hidden_size"],
    head_dim=16,
    deepstack_visual_indexes=[1],
    # an audio tower's (Whisper's names: Qwen-Omni's, Qwen2-Audio's)
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=64,
    output_dim=_SIZES["hidden_size"],
    downsample_hidden_size=16,
)
# A tower's settings an architecture's bridge assumes: Gemma 3's SigLIP tower has no pooling head (its released
# configs say so; its bridge builds none), where SiglipVisionConfig's default builds one.
_TOWER_OVERRIDES = {"Gemma3ForConditionalGeneration": dict(vision_use_head=False)}


def _small(config_class, architecture: str, known_only: bool = False, **extra):
    """``config_class`` at the small sizes, with the expert sizes where the class has experts (the bridge reads
    num_local_experts & co. from any config) and the architecture's own (``_ARCHITECTURE_SIZES``). Every name is
    passed, also those the class lacks: some bridges read them (HYV3's first_k_dense_replace); ``known_only`` for
    a multimodal model's text config, whose every attribute some bridges pass on to their provider (Qwen3-VL)."""
    defaults = config_class()
    moe = any(hasattr(defaults, name) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    sizes = {**_SIZES, **(_MOE_SIZES if moe else {})}
    if hasattr(defaults, "linear_num_key_heads"):  # its MTP layer is written (_add_mtp_weights), under its own name
        sizes = {**sizes, **_GATED_DELTANET_SIZES}
        sizes.pop("num_nextn_predict_layers", None)
    if hasattr(defaults, "kv_lora_rank"):  # multi-latent attention: its head_dim is the rotary part (GLM-4.7-Flash)
        sizes["head_dim"] = _MOE_SIZES["qk_rope_head_dim"]
    if known_only:
        sizes = {name: value for name, value in sizes.items() if hasattr(defaults, name)}
    config = config_class(**{**sizes, **_ARCHITECTURE_SIZES.get(architecture, {})}, **extra)
    if hasattr(defaults, "linear_num_key_heads"):
        config.mtp_num_hidden_layers = 1  # not a field of transformers' class: kept as the released config.json has it
    return config


def _hf_config(fixture: str):
    """The architecture's config class at small sizes; a multimodal one with a small text model and towers.
    ``fixture``: the architecture, or ``<architecture>+<variant>`` for another form of it (its own sizes, only the
    names its config class knows: the Gemma 4 bridge passes every one on to its provider)."""
    import transformers

    architecture = fixture.partition("+")[0]
    config_class = getattr(transformers, architecture).config_class
    sub_configs = getattr(config_class, "sub_configs", {})
    if "thinker_config" in sub_configs:  # Omni: the bridge builds the thinker only; no speech output (talker)
        thinker = _multimodal_config(sub_configs["thinker_config"], architecture)
        return config_class(thinker_config=thinker, enable_audio_output=False, architectures=[architecture])
    if "text_config" not in sub_configs:
        return _small(config_class, fixture, known_only=fixture != architecture, architectures=[architecture])
    return _multimodal_config(config_class, fixture, architectures=[architecture])


def _multimodal_config(config_class, architecture: str, **extra):
    """A config of a small text model and small towers."""
    # The sub-configs' classes as the default config builds them (some are declared as AutoConfig); one the default
    # leaves out (Gemma 4's towers) as declared.
    defaults = config_class()
    sub_configs = {
        name: declared if getattr(defaults, name) is None else type(getattr(defaults, name))
        for name, declared in config_class.sub_configs.items()
    }
    text = _small(sub_configs.pop("text_config"), architecture, known_only=True)
    towers = {
        name: tower(
            **{key: value for key, value in _TOWER_SIZES.items() if hasattr(tower(), key)},
            **_TOWER_OVERRIDES.get(architecture, {}),
        )
        for name, tower in sub_configs.items()
    }
    return config_class(
        text_config=text,
        **towers,
        tie_word_embeddings=getattr(text, "tie_word_embeddings", _SIZES["tie_word_embeddings"]),
        **extra,
    )


def _hf_model(fixture: str):
    """A tiny transformers model of ``fixture`` (see ``_hf_config``): its config class with the small sizes above."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, fixture.partition("+")[0])(_hf_config(fixture)).float()
    with torch.no_grad():  # norms away from their all-ones init, so a swapped norm cannot pass
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
    return model


# Names transformers 5.12.1's save_pretrained gives that neither the released checkpoints nor the bridge's registry
# use, as (saved prefix, released prefix): the tiny model is saved under the released names, which the bridge loads.
# Nemotron-H's embedding (its loader renames embedding.weight to embeddings.weight, its save the reverse); Qwen2-Audio's
# language model (5.12.1's checkpoint conversion's reversal doubles the model.; 5.25 saves language_model.model.*).
_RELEASED_NAMES = {
    "NemotronHForCausalLM": ("backbone.embedding.", "backbone.embeddings."),
    "Qwen2AudioForConditionalGeneration": ("language_model.model.model.", "language_model.model."),
}


def _released_names(folder: Path, architecture: str) -> None:
    """The saved model's names with ``_RELEASED_NAMES``' prefix replaced, where the architecture has one."""
    from safetensors.torch import load_file, save_file

    if architecture not in _RELEASED_NAMES:
        return
    prefix, released = _RELEASED_NAMES[architecture]
    path = folder / "model.safetensors"
    tensors = load_file(path)
    renamed = {released + n.removeprefix(prefix) if n.startswith(prefix) else n: t for n, t in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


def _add_mtp_weights(folder: Path) -> None:
    """The multi-token-prediction layer a config asks for (``mtp_num_hidden_layers``: Qwen3-Next, Qwen3.5) that
    transformers builds no module for (it ignores ``mtp.*`` on load): written into the saved model as the released
    checkpoints hold it, the projection of [embedding; hidden] (``mtp.fc``), its norms and one decoder layer: a copy of
    the last (full-attention) layer's tensors, values moved, under ``mtp.layers.0.``."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "config.json").read_text())
    if not config.get("text_config", config).get("mtp_num_hidden_layers"):
        return
    path = folder / "model.safetensors"
    tensors = load_file(path)
    last = max(int(k.split(".layers.")[1].split(".")[0]) for k in tensors if k.startswith("model.") and ".layers." in k)
    prefix = next(k for k in tensors if f"layers.{last}." in k).split(f"layers.{last}.")[0] + f"layers.{last}."
    hidden = next(t for k, t in tensors.items() if k.endswith("embed_tokens.weight")).shape[1]
    values = torch.Generator().manual_seed(2)
    for key in [k for k in tensors if k.startswith(prefix)]:
        tensors["mtp.layers.0." + key.removeprefix(prefix)] = tensors[key] + 0.01 * torch.randn(
            tensors[key].shape, generator=values
        )
    tensors["mtp.fc.weight"] = 0.05 * torch.randn(hidden, 2 * hidden, generator=values)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.rand(hidden, generator=values) * 0.5 + 0.5
    save_file(tensors, str(path), metadata={"format": "pt"})


def _save_families(rank: int, world_size: int, out: str, families: list[str]) -> None:
    _patch_for_cpu()
    for family in families:
        bridge, model = _save(rank, Path(out) / family, FAMILIES[family], world_size, local_spec=True)
        try:
            if family == LORA_FAMILY:
                _save_lora(bridge, model, Path(out) / family / "lora", rank)
        finally:
            _release(model)


def _save(rank: int, out: Path, fixture: str, world_size: int, *, local_spec: bool):
    """Build ``fixture`` (an architecture, or ``<architecture>+<variant>``: ``_hf_config``) through the bridge on
    ``world_size`` gloo ranks and save it as verl does (see the module's docstring); the bridge's spec unless
    ``local_spec`` (megatron-core's local layers, with the bridge's ``save_hf_weights`` beside the shards). Returns
    the bridge and the model, parallel state still up."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    auto_bridge = _import_bridge()
    architecture = fixture.partition("+")[0]
    if rank == 0:
        _hf_model(fixture).save_pretrained(out / "hf")
        _add_mtp_weights(out / "hf")
        _released_names(out / "hf", architecture)
        if architecture in _SPEAKERS:  # as its releases ship them: its from_pretrained refuses a folder without
            torch.save({}, out / "hf" / _SPEAKERS[architecture])
    dist.barrier()
    bridge = auto_bridge.from_hf_pretrained(str(out / "hf"), torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    moe = bool(getattr(provider, "num_moe_experts", None))
    ep = world_size if moe else 1
    tp = _TENSOR_PARALLEL.get(architecture, world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
    )
    provider.tensor_model_parallel_size = tp
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = 1
    provider.params_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    if moe:  # TransformerEngine's fused permutation and router kernels: not stood in
        provider.moe_permute_fusion = provider.moe_router_fusion = False
        provider.moe_token_dispatcher_type = "allgather"  # alltoall opens a CUDA stream; saving routes nothing
        provider.moe_shared_expert_overlap = False  # only with alltoall
    if local_spec:
        provider.transformer_layer_spec = get_gpt_layer_local_spec(
            normalization=provider.normalization, qk_layernorm=provider.qk_layernorm
        )
    for fusion in _CUDA_FUSIONS:  # kernels of TransformerEngine / apex: none on CPU
        setattr(provider, fusion, False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    role = out / "actor"
    dist_checkpointing.save(model[0].sharded_state_dict(), str(_fresh(role / "model" / "dist_ckpt")))
    if rank == 0:
        bridge.hf_pretrained.config.save_pretrained(role / "model" / "huggingface")
    dist.barrier()
    if local_spec:
        bridge.save_hf_weights(model, str(role / "model" / "huggingface"))
    exported = {name: tensor.clone() for name, tensor in bridge.export_hf_weights(model, cpu=True)}
    if rank == 0:
        _write_expected(out, exported, model[0].config, role)
        (out / "layout.txt").write_text(f"TP={tp}" + (f", EP={ep}" if moe else "") + "\n")
    dist.barrier()
    return bridge, model


def _release(model) -> None:
    from megatron.core import parallel_state

    del model[:]
    parallel_state.destroy_model_parallel()


def _save_lora(bridge, model, out: Path, rank: int) -> None:
    """verl with the bridge and LoRA: the bridge's LoRA on the same model, its adapters given values
    (LoRA starts B at zero), then ``save_hf_adapter`` into ``model/huggingface/adapter/`` beside the HF
    config, no base weights. ``OUT/<family>/lora/expected_merged/`` is the bridge's own export with the
    adapters merged (``export_hf_weights(merge_adapter_weights=True)``)."""
    from megatron.bridge.peft.lora import LoRA
    from safetensors.torch import save_file

    lora = LoRA(target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"], dim=4, alpha=8)
    model = lora(model, training=False)
    values = torch.Generator().manual_seed(1)  # the same on every rank: replicated adapters agree
    with torch.no_grad():
        for name, param in model[0].named_parameters():
            if ".adapter." in name:
                param.copy_(torch.randn(param.shape, generator=values) * 0.05)
    huggingface = out / "actor" / "model" / "huggingface"
    if rank == 0:
        bridge.hf_pretrained.config.save_pretrained(huggingface)
        (out / "actor" / "model" / "dist_ckpt").mkdir(parents=True, exist_ok=True)
    dist.barrier()
    bridge.save_hf_adapter(model, str(huggingface / "adapter"), lora)
    merged = {name: t.clone() for name, t in bridge.export_hf_weights(model, cpu=True, merge_adapter_weights=True)}
    if rank == 0:
        (out / "expected_merged").mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "expected_merged" / "model.safetensors"))
    dist.barrier()


def _fresh(folder: Path) -> Path:
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    return folder


def _write_expected(out: Path, exported: dict, config, role: Path) -> None:
    from dataclasses import fields

    from safetensors.torch import save_file

    (out / "expected").mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in exported.items()}, str(out / "expected" / "model.safetensors"))
    plain = {  # verl saves the TransformerConfig in the role folder
        f.name: getattr(config, f.name)
        for f in fields(config)
        if isinstance(getattr(config, f.name), (bool, int, float, str, type(None)))
    }
    (role / "transformer_config.json").write_text(json.dumps(plain, indent=2, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--family", choices=list(FAMILIES), nargs="+", default=list(FAMILIES))
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spawn_gloo_ranks(_save_families, (str(args.out_dir), args.family), args.world_size)
    for family in args.family:
        print(args.out_dir / family / "actor")


if __name__ == "__main__":
    main(sys.argv[1:])
