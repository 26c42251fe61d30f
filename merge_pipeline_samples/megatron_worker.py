"""One rank of a megatron-core job that writes sample dist checkpoints on CPU (run by torchrun).

For each requested variant: build a GPTModel with the local (non-TransformerEngine) layer spec, give
every parameter values that depend only on its checkpoint key and global position (so all ranks and
the reference agree, whatever the parallel layout), save it with ``dist_checkpointing.save`` like
verl (or as Megatron-LM's ``save_checkpoint``), and optionally run megatron-core's own forward pass to record logits.

    torchrun --nproc_per_node 2 -m merge_pipeline_samples.megatron_worker JOB.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from merge_pipeline_samples.megatron import (
    GLM_ROTARY_FRACTION,
    MLA_SIZES,
    ROUTED_SCALING,
    SWIGLU_LIMIT,
    Variant,
    global_values,
    sample_tokens,
)


def _patch_for_cpu() -> None:
    # dist_checkpointing calls these around its save; there is no CUDA here.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    # Tied embeddings across pipeline stages are synchronised with ``weight.data.cuda()``.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # megatron-core 0.16 leaves this name undefined without TransformerEngine; the router then
    # falls back to torch.mm once it is None.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    # Its TransformerEngine extension module imports without TransformerEngine, so multi-latent
    # attention believes TE is there and calls isinstance(linear_proj, None).
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = False


def _transformer_config(v: Variant):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dtype = getattr(torch, v.dtype)
    specific = {}  # settings of the model family
    if v.record.moe:
        specific = dict(
            num_moe_experts=v.sizes["experts"],
            moe_router_topk=v.sizes["experts_per_token"],
            moe_ffn_hidden_size=v.sizes["moe_ffn"],
            moe_token_dispatcher_type="allgather",  # the only dispatcher that runs on CPU
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            # Qwen2-MoE: softmax over all experts, then top-k, no renormalisation. Mixtral, Qwen3-MoE:
            # softmax over the top-k logits (= softmax, top-k, renormalise, as transformers does).
            moe_router_pre_softmax=v.family == "qwen2_moe",
        )
        if v.record.shared_expert_gate and v.sizes["shared_ffn"]:  # 0: no shared expert at all
            specific.update(moe_shared_expert_intermediate_size=v.sizes["shared_ffn"], moe_shared_expert_gate=True)
    config_class = TransformerConfig
    if _dense_then_moe(v):  # as DeepseekV3Config's and GLM-4.5's: sigmoid router, scaled, group of one
        specific.update(
            moe_shared_expert_intermediate_size=v.sizes["moe_ffn"] * MLA_SIZES["shared_experts"],
            moe_layer_freq=[0] + [1] * (v.num_layers - 1),  # first_k_dense_replace=1
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=ROUTED_SCALING,
            mtp_num_layers=v.mtp_layers or None,
        )
    if v.record.latent_attention:
        config_class = MLATransformerConfig
        m = MLA_SIZES
        specific.update(
            q_lora_rank=m["q_lora_rank"],
            kv_lora_rank=m["kv_lora_rank"],
            qk_head_dim=m["qk_nope"],
            qk_pos_emb_head_dim=m["qk_rope"],
            v_head_dim=m["v_head"],
            rope_type="rope",
            rotary_base=v.sizes["rope_theta"],
            num_query_groups=v.sizes["heads"],  # MLA: every head has its own key and value
        )
    else:
        specific.update(num_query_groups=v.sizes["kv_heads"])
    activation = F.silu
    if v.family == "gpt_oss":  # as Megatron-Bridge's GPT-OSS: sinks, biases, clamped (up + 1) * quick_gelu(gate)
        from megatron.core.activations import quick_gelu

        activation = quick_gelu
        specific.update(
            softmax_type="learnable",
            glu_linear_offset=1.0,
            activation_func_clamp_value=SWIGLU_LIMIT,
            expert_tensor_parallel_size=_expert_tp(v),
        )
    return config_class(
        num_layers=v.num_layers,
        hidden_size=v.sizes["hidden"],
        num_attention_heads=v.sizes["heads"],
        kv_channels=v.sizes["head_dim"],
        ffn_hidden_size=v.sizes["ffn"],
        normalization="RMSNorm",
        layernorm_epsilon=v.sizes["norm_eps"],
        gated_linear_unit=True,
        activation_func=activation,
        add_bias_linear=v.family == "gpt_oss",  # gpt-oss: every linear (router, experts) has a bias
        add_qkv_bias=v.record.qkv_bias,
        qk_layernorm=v.record.qk_norm or v.record.latent_attention,  # MLA: the compressed q and kv norms
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=v.tp,
        pipeline_model_parallel_size=v.pp,
        virtual_pipeline_model_parallel_size=v.vpp if v.vpp > 1 else None,
        expert_model_parallel_size=v.ep,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **specific,
    )


def _expert_tp(v: Variant) -> int | None:
    """megatron-core supports biases in MoE experts only without expert tensor parallelism (gpt-oss):
    its experts are then replicated over the TP ranks. None: the default, TP's size."""
    return 1 if v.family == "gpt_oss" else None


def _dense_then_moe(v: Variant) -> bool:
    """DeepSeek-V3 and GLM-4.5: a dense first layer, then MoE layers (one layer spec each)."""
    return v.record.latent_attention or v.family == "glm4_moe"


def _build_model(v: Variant, config, vp_stage: int | None = None):
    """The model of this rank, or with virtual pipeline stages its ``vp_stage``-th chunk of layers."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )

    mtp_spec = None
    if _dense_then_moe(v):  # dense and MoE layers: one spec per layer
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if v.record.latent_attention:
            for layer_spec in spec.layer_specs:
                layer_spec.submodules.self_attention.submodules.core_attention = _mla_core_attention()
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=v.sizes["experts"] if v.record.moe else None,
            normalization="RMSNorm",
            qk_layernorm=v.record.qk_norm,
        )
    model = GPTModel(
        config,
        spec,
        vocab_size=v.sizes["vocab"],
        max_sequence_length=v.sizes["max_positions"],
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=v.tied,
        position_embedding_type="rope",
        rotary_base=v.sizes["rope_theta"],
        rotary_percent=GLM_ROTARY_FRACTION if v.family == "glm4_moe" else 1.0,
        parallel_output=False,  # gather logits over TP ranks
        mtp_block_spec=mtp_spec,
        vp_stage=vp_stage,
    )
    if v.value_model and model.post_process:  # the chunk that holds the LM head
        # verl's critic replaces the LM head with a bias-free Linear of one output.
        model.output_layer = torch.nn.Linear(v.sizes["hidden"], 1, bias=False, dtype=config.params_dtype)
    return model.eval()


def _mla_core_attention():
    """megatron-core's local DotProductAttention, told the width of MLA's values: multi-latent
    attention passes ``k_channels`` / ``v_channels`` (query/key and value head sizes differ), which
    only TransformerEngine's attention accepts. The scale comes from MLA as ``softmax_scale``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # the output is heads x value width, not x kv_channels
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def _metadata(v: Variant) -> dict | None:
    # singleton_local_shards: one key per layer (and per expert), gated fc1 as weight_w / weight_v.
    return {"singleton_local_shards": True} if v.per_layer_keys else None


def _fill(model, v: Variant, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Set each local shard from the global tensor of its checkpoint key (taken from ``full`` when
    there, else generated and added to it). Returns the global tensors this rank owns (it holds
    their first chunk's main replica), so each is saved once."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories, is_main_replica

    sharded = model.sharded_state_dict(metadata=_metadata(v))
    apply_factories(sharded)
    full = {} if full is None else full
    owned: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for item in nested_values(sharded):
            if not isinstance(item, ShardedTensor):
                continue
            if item.key not in full:
                full[item.key] = global_values(item.key, item.global_shape, item.data.dtype, v.seed)
            item.data.copy_(full[item.key][item.global_slice()].reshape(item.data.shape))
            if is_main_replica(item.replica_id) and not any(item.global_offset):
                owned[item.key] = full[item.key]
    return owned


def _forward_logits(model, out_dir: Path) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # Attention forks a CUDA RNG stream for dropout; dropout is off and there is no CUDA.
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()

    tokens = sample_tokens().unsqueeze(0)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    # True = masked. Passing the mask avoids megatron's default causal mask, which is built on CUDA.
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        if model.mtp_process:
            # With MTP the model returns losses (it needs labels); the main head's logits are the
            # output layer's last call (the MTP modules' come first), copied before the loss
            # computation overwrites them in place.
            calls = []
            hook = model.output_layer.register_forward_hook(
                lambda module, args, output: calls.append(output[0].clone())
            )
            model(tokens, positions, causal, labels=tokens)
            hook.remove()
            logits = calls[-1].transpose(0, 1)  # [s, b, V] -> [b, s, V], as GPTModel returns it
        else:
            logits = model(tokens, positions, causal)
    if parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_expert_model_parallel_rank() == 0:
        torch.save(logits[0].float().clone(), out_dir / "megatron_logits.pt")


def _write_variant(v: Variant, out_dir: Path, dist_dir: Path, megatron_lm_iteration: int | None) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=v.tp,
        pipeline_model_parallel_size=v.pp,
        virtual_pipeline_model_parallel_size=v.vpp if v.vpp > 1 else None,
        expert_model_parallel_size=v.ep,
        expert_tensor_parallel_size=_expert_tp(v),
    )
    try:
        config = _transformer_config(v)
        chunks, full, sharded = _model_chunks(v, config)
        role_dir = out_dir / "actor"
        if megatron_lm_iteration is None:
            dist_checkpointing.save(sharded, str(dist_dir))
        else:
            _save_as_megatron_lm(sharded, dist_dir, megatron_lm_iteration, v)
        torch.save(full, out_dir / f"full_weights_rank{dist.get_rank()}.pt")
        if dist.get_rank() == 0 and megatron_lm_iteration is None:
            _write_transformer_config(config, role_dir / "transformer_config.json")
        if v.logits:
            _forward_logits(chunks[0], out_dir)  # variants with logits have no pipeline: one chunk
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()


def _model_chunks(v: Variant, config) -> tuple[list, dict[str, torch.Tensor], dict]:
    """This rank's model (with virtual pipeline stages, its ``v.vpp`` chunks of layers), filled; the
    global tensors it owns; and what it saves: the model's sharded state dict, or each chunk's under
    ``model0``, ``model1``, ... made with its virtual rank set, as verl's checkpoint manager saves them."""
    from megatron.core import parallel_state

    if v.vpp == 1:
        model = _build_model(v, config)
        return [model], _fill(model, v), model.sharded_state_dict(metadata=_metadata(v))
    chunks, owned, full, sharded = [], {}, {}, {}
    for stage in range(v.vpp):
        parallel_state.set_virtual_pipeline_model_parallel_rank(stage)
        chunks.append(_build_model(v, config, stage))
        owned |= _fill(chunks[-1], v, full)
        sharded[f"model{stage}"] = chunks[-1].sharded_state_dict(metadata=_metadata(v))
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return chunks, owned, sharded


def _save_as_megatron_lm(sharded: dict, iteration_dir: Path, iteration: int, v: Variant) -> None:
    """What Megatron-LM's ``save_checkpoint`` writes with ``--ckpt-format torch_dist`` (reproduced from
    megatron/training/checkpointing.py at NVIDIA/Megatron-LM d98e8a64): ``generate_state_dict``'s
    ``args`` (an argparse Namespace), ``checkpoint_version`` 3.0, ``iteration`` and the model's sharded
    state dict under ``model``, saved by ``dist_checkpointing.save`` into ``<save>/iter_<7 digits>/``;
    then rank 0 writes the iteration to ``<save>/latest_checkpointed_iteration.txt``."""
    from megatron.core import dist_checkpointing

    args = argparse.Namespace(
        ckpt_format="torch_dist",
        tensor_model_parallel_size=v.tp,
        pipeline_model_parallel_size=v.pp,
        expert_model_parallel_size=v.ep,
    )
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": sharded}
    dist_checkpointing.save(state, str(iteration_dir))
    dist.barrier()
    if dist.get_rank() == 0:
        (iteration_dir.parent / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def _write_transformer_config(config, path: Path) -> None:
    """verl saves the TransformerConfig in the role folder; its plain fields are what readers use."""
    from dataclasses import fields

    plain = {
        f.name: getattr(config, f.name)
        for f in fields(config)
        if isinstance(getattr(config, f.name), (bool, int, float, str, type(None)))
    }
    path.write_text(json.dumps(plain, indent=2, sort_keys=True))


def main(job_path: Path) -> None:
    warnings.filterwarnings("ignore")
    _patch_for_cpu()
    job = json.loads(job_path.read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    try:
        for entry in job["variants"]:
            out_dir, dist_dir = Path(entry["out_dir"]), Path(entry["dist_dir"])
            if dist.get_rank() == 0:
                dist_dir.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            _write_variant(Variant(**entry["variant"]), out_dir, dist_dir, entry.get("megatron_lm_iteration"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing spawns a helper that re-imports this module
    main(Path(sys.argv[1]))
