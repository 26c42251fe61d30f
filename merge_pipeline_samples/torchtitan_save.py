"""A torchtitan 0.3 checkpoint written by torchtitan itself: run with the torchtitan venv's python.

    .venv-torchtitan/bin/python merge_pipeline_samples/torchtitan_save.py OUT --family llama3

``scripts/setup_torchtitan.sh`` builds that venv (torchtitan's dependencies clash with ours), so this
file imports only torch, torchtitan, safetensors and, of merge_pipeline, the standard-library-only
``families.py`` (each family's HF architecture and layout). Two gloo ranks each build
the family's ``debugmodel`` flavor from torchtitan's own registry (cut to two layers), ``fully_shard``
it (torchtitan's ``parallelize`` calls the same FSDP2 API) and save with torchtitan's
``CheckpointManager`` (with its AdamW ``OptimizersContainer`` and ``LRSchedulersContainer``) into
``OUT/<family>/checkpoint/step-1/`` (DCP), then ``step-2/`` as the last step with ``last_save_in_hf``
(its HuggingFaceStorageWriter: ``model-*.safetensors`` + index, and ``sharded/``; not for qwen3_5_moe,
where torchtitan 0.3.0's own HF save fails). Rank 0 then
converts the gathered state dict with the family's own ``state_dict_adapter.to_hf`` and writes
``OUT/<family>/expected/model.safetensors`` (what a merge must equal, bit for bit; for gpt_oss, whose
``to_hf`` drops its grouped experts, also ``expected/grouped_experts.safetensors``: those tensors as
torchtitan holds them) and
``OUT/<family>/hf/config.json`` (the HF config a user passes as ``--hf_model_path``), and for the
``LOGITS`` families ``OUT/<family>/expected/logits.safetensors``: torchtitan's own forward of those weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script in torchtitan's venv
from merge_pipeline.families import by_model_type  # noqa: E402  (after the path it is found on)
from merge_pipeline_samples.gloo_ranks import spawn_gloo_ranks  # noqa: E402

# family -> (torchtitan flavor, HF model_type); the HF config is derived from the torchtitan config below.
FAMILIES = {
    "llama3": ("debugmodel", "llama"),
    "qwen3": ("debugmodel", "qwen3"),
    "qwen3_moe": ("debugmodel_moe", "qwen3_moe"),
    "deepseek_v3": ("debugmodel", "deepseek_v3"),
    "kimi_k2_7": (
        "debugmodel",
        "kimi_k25",
    ),  # Kimi-K2.5: DeepSeek-V3 beside a MoonViT vision tower
    "qwen3_5": ("debugmodel", "qwen3_5"),  # hybrid linear attention and a vision tower
    "qwen3_5_moe": ("debugmodel_moe", "qwen3_5_moe"),  # its MoE flavor: experts beside a shared expert
    "gpt_oss": ("debugmodel", "gpt_oss"),
}
# Families whose torchtitan forward runs on CPU and whose HF class transformers builds (qwen3_5's linear
# attention needs flash-linear-attention's GPU kernels, so qwen3_5_moe is built with full attention only;
# kimi_k2_7 is checked by names only).
LOGITS = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5_moe", "gpt_oss")
EXPERTS = "grouped_experts.safetensors"  # gpt_oss: the expert tensors its to_hf drops, as torchtitan holds them
FULL_STATE = "torchtitan_full_state.pt"  # the saved weights, whole, from rank 0 to main() for the forward
# deepseek_v3 routed as transformers' DeepseekV3TopkRouter routes: sigmoid scores, the expert bias added to
# choose (only), the top-k within the best group of two, the chosen scores normalized, then scaled.
DEEPSEEK_V3_ROUTING = dict(
    score_func="sigmoid", num_expert_groups=2, num_limited_groups=1, route_norm=True, route_scale=2.5
)
VOCAB = 2048  # qwen3_5's debug flavor keeps the real 248k vocabulary: 2 GB with the optimizer
STEP = 1
LAST_STEP = 2


def _spec(family: str):
    """The family's registered debug model, cut to two layers (the first MoE one included) to stay small."""
    if family.startswith("qwen3_5"):
        _stub_flash_linear_attention()
    module = importlib.import_module(f"torchtitan.models.{family.removesuffix('_moe')}")
    spec = module.model_registry(FAMILIES[family][0])
    layers = spec.model.layers
    model = spec.model
    if family == "qwen3_moe":  # its debug flavor has 64 experts of 768 rows: 4.8 GB with the optimizer
        layers = module._build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=spec.model.dim,
            n_heads=16,
            n_kv_heads=8,
            head_dim=128,
            moe_hidden_dim=64,
            num_experts=4,
            top_k=2,
            attn_backend="flex",
            rope=layers[0].attention.rope,
            moe_comm_backend="standard",
        )
    elif family == "gpt_oss":  # its debug flavor's experts are 2880 wide: 0.4 GB with the optimizer
        layers = module._build_gptoss_layers(
            dim=model.dim,
            n_layers=2,
            hidden_dim=64,
            num_experts=4,
            top_k=2,
            load_balance_coeff=1e-3,
            moe_comm_backend="standard",
            rope=layers[0].attention.rope,
            attn_backend="flex",  # its default, varlen, needs a GPU for the forward; the names are the same
        )
    elif family == "deepseek_v3":  # its debug flavor routes by softmax: routed as transformers' DeepseekV3 instead
        moe = layers[1].moe
        router = dataclasses.replace(moe.router, **DEEPSEEK_V3_ROUTING)
        layers = [layers[0], dataclasses.replace(layers[1], moe=dataclasses.replace(moe, router=router))]
    elif family == "qwen3_5_moe":  # full attention only (see LOGITS); experts 64 wide, not dim: a transpose shows
        attention = model.first_attention
        layers = module._build_qwen35_moe_layers(
            n_layers=2,
            full_attention_interval=1,
            dim=model.dim,
            n_heads=attention.n_heads,
            n_kv_heads=attention.n_kv_heads,
            head_dim=attention.head_dim,
            rotary_dim=attention.rotary_dim,
            rope=attention.rope,
            moe_hidden_dim=64,
            num_experts=4,
            top_k=2,
            shared_expert_hidden_dim=128,
            n_key_heads=2,
            n_value_heads=4,
            key_head_dim=64,
            value_head_dim=64,
            attn_backend="flex",
        )
    if family.startswith("qwen3_5"):  # its vocabulary cut to VOCAB
        model = dataclasses.replace(
            model,
            vocab_size=VOCAB,
            tok_embeddings=dataclasses.replace(model.tok_embeddings, num_embeddings=VOCAB),
            lm_head=dataclasses.replace(model.lm_head, out_features=VOCAB),
        )
    keep = 4 if family == "qwen3_5" else 2  # qwen3_5: three linear-attention layers, then a full-attention one
    return dataclasses.replace(spec, model=dataclasses.replace(model, layers=layers[:keep]))


def _stub_flash_linear_attention() -> None:
    """qwen3_5's model imports flash-linear-attention's Triton kernels (``fla``), which need a GPU: its
    forward pass, never run here, is all that uses them. Empty modules stand in for the import."""
    import types

    kernels = {
        "fla.modules.conv.triton.ops": ("CausalConv1dFunction",),
        "fla.modules.conv.causal_conv1d": ("causal_conv1d",),
        "fla.ops.gated_delta_rule": (
            "chunk_gated_delta_rule",
            "fused_recurrent_gated_delta_rule",
        ),
        "fla.ops.gated_delta_rule.chunk": ("ChunkGatedDeltaRuleFunction",),
        "fla.ops.gated_delta_rule.fused_recurrent": ("FusedRecurrentFunction",),
    }
    for name, attributes in kernels.items():
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for attribute in attributes:
            setattr(sys.modules[name], attribute, None)


def _save_families(rank: int, world_size: int, out: str, families: list[str]) -> None:
    for family in families:
        _save_family(rank, family, Path(out) / family, world_size)


def _save_family(rank: int, family: str, out: Path, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw

    torch.manual_seed(0)
    spec = _spec(family)
    with torch.device("meta"):
        model = spec.model.build()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        if family == "deepseek_v3":  # as training's load balancing leaves it, so that routing depends on it
            for block in model.layers.values():
                if getattr(block, "moe", None) is not None:
                    bias = torch.randn(block.moe.expert_bias_E.shape, generator=torch.Generator().manual_seed(1))
                    block.moe.expert_bias_E.copy_(0.05 * bias)
    optimizers = default_adamw(implementation="for-loop").build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config().build(optimizers=optimizers, training_steps=10)
    # Every step saves the DCP; the last one as HF safetensors (``last_save_in_hf``, through to_hf).
    manager = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, last_save_in_hf=True).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": _TrainState()},
        sd_adapter=spec.state_dict_adapter(spec.model, None),
        base_folder=str(out),
    )
    manager.save(curr_step=STEP)
    if family != "qwen3_5_moe":  # torchtitan 0.3.0 fails to: its to_hf's transposed experts are not contiguous,
        manager.save(curr_step=LAST_STEP, last_step=True)  # which safetensors refuses to save
    manager.close()
    # The whole tensors, gathered on every rank (collectives), as the model holds them.
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if rank == 0:
        _write_expected(out, family, spec, full)
        if family in LOGITS:  # its forward runs in main(), once the ranks are gone
            torch.save(full, out / "expected" / FULL_STATE)


def _write_logits(out: Path, family: str, spec, full: dict) -> None:
    """torchtitan's own forward (eval, fp32, CPU) of the saved weights, loaded whole into an unsharded
    model, on fixed token ids: what the merged folder's transformers forward must give."""
    from safetensors.torch import save_file
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models.common.attention import FlexAttention

    set_spmd_backend("full_dtensor")  # plain tensors, no mesh: nothing for its default spmd_types to check
    if family == "gpt_oss":
        # Its sinks need flex attention's log-sum-exp, which torch.compile cannot lower on CPU
        # ("return_lse is not supported yet"): the same function, run uncompiled.
        from torch.nn.attention.flex_attention import flex_attention

        FlexAttention._compiled_flex_attn = flex_attention
        # Its experts multiply in bf16 and return bf16, which its combine (a scatter_add into the fp32
        # output of an fp32 model) refuses: their output cast to fp32 at the combine, nothing else changed.
        from torchtitan.models.gpt_oss.moe import GptOssGroupedExperts

        bf16_forward = GptOssGroupedExperts.forward
        GptOssGroupedExperts.forward = lambda self, *args, **kwargs: bf16_forward(self, *args, **kwargs).float()
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))  # the non-persistent rotary tables
    model.load_state_dict(full, strict=True)
    model.eval()
    vocab = full["tok_embeddings.weight"].shape[0]
    input_ids = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    # As torchtitan's trainer does: a flex-attention model takes its causal BlockMask from the model.
    flex = isinstance(model.config.first_attention.inner_attention, FlexAttention.Config)
    masks = model.get_attention_masks(positions) if flex else None
    # qwen3_5 asks for its image and video token ids even with no image: none of these tokens is one.
    text_only = {"special_tokens": {"image_id": -1, "video_id": -1}} if spec.name == "qwen3_5" else {}
    with torch.no_grad():
        logits = model(input_ids, positions=positions, attention_masks=masks, **text_only).float()
    save_file({"input_ids": input_ids, "logits": logits.contiguous()}, str(out / "expected" / "logits.safetensors"))


class _TrainState:
    """What torchtitan's Trainer saves as ``train_state`` (its ``state_dict``)."""

    def state_dict(self) -> dict:
        return {"step": torch.tensor(STEP), "ntokens_seen": torch.tensor(0)}

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError


def _write_expected(out: Path, family: str, spec, full: dict) -> None:
    from safetensors.torch import save_file

    adapter = spec.state_dict_adapter(spec.model, None)
    hf = adapter.to_hf({k: v for k, v in full.items() if not k.endswith("freqs_cis")})
    if family == "qwen3_5_moe":
        hf = _experts_as_transformers_loads(hf)
    (out / "expected").mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in hf.items()},
        str(out / "expected" / "model.safetensors"),
    )
    if family == "gpt_oss":  # its to_hf drops the grouped experts: kept as the model holds them
        experts = {k: v.contiguous() for k, v in full.items() if ".inner_experts." in k}
        save_file(experts, str(out / "expected" / EXPERTS))
    (out / "hf").mkdir(parents=True, exist_ok=True)
    (out / "hf" / "config.json").write_text(json.dumps(_hf_config(family, spec.model, hf), indent=2))


def _experts_as_transformers_loads(hf: dict) -> dict:
    """qwen3_5's to_hf writes the experts transposed and fused, ``gate_up_proj`` [E, D, 2F] and ``down_proj``
    [E, F, D], which transformers 5's Qwen3_5Moe does not load ([E, 2F, D], [E, D, F]): turned back and split
    per expert (``experts.<e>.gate_proj.weight`` [F, D], ...), the names transformers loads and fuses."""
    split = {}
    for name, tensor in hf.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, (gate, up) in enumerate(t.transpose(0, 1).chunk(2) for t in tensor):
                split[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                split[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, t in enumerate(tensor):
                split[name.replace("down_proj", f"{e}.down_proj.weight")] = t.transpose(0, 1)
        else:
            split[name] = tensor
    return split


def _hf_config(family: str, config, hf: dict) -> dict:
    """The HF config of the same model, from torchtitan's config and the converted shapes."""
    record = by_model_type(FAMILIES[family][1])
    nested = record.text_prefix if getattr(config, "vision_encoder", None) is not None else "model."
    attention = next(block.attention for block in config.layers if getattr(block, "attention", None) is not None)
    embed = hf[nested + "embed_tokens.weight"]
    moe_layers = [i for i, block in enumerate(config.layers) if getattr(block, "moe", None) is not None]
    base = {
        "model_type": FAMILIES[family][1],
        "architectures": [record.architectures[0]],
        "vocab_size": embed.shape[0],
        "hidden_size": embed.shape[1],
        "num_hidden_layers": len(config.layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": getattr(attention, "n_kv_heads", None) or attention.n_heads,
        "tie_word_embeddings": bool(getattr(config, "enable_weight_tying", False)),
        "rms_norm_eps": config.norm.eps,
        "torch_dtype": "float32",
        **_rope(attention),
    }
    mlp = next((k for k in hf if k.endswith("mlp.gate_proj.weight")), None)
    if mlp is not None:
        base["intermediate_size"] = hf[mlp].shape[0]
    if record.qk_norm:  # its q/k norms are one head wide
        base["head_dim"] = next(t for k, t in hf.items() if k.endswith("self_attn.q_norm.weight")).shape[0]
    elif family == "gpt_oss":
        base["head_dim"] = attention.head_dim
    if record.latent_attention:
        base["kv_lora_rank"] = attention.kv_lora_rank
        base["q_lora_rank"] = attention.q_lora_rank or None
        base["qk_nope_head_dim"] = attention.qk_nope_head_dim
        base["qk_rope_head_dim"] = attention.qk_rope_head_dim
        base["v_head_dim"] = attention.v_head_dim
        base["first_k_dense_replace"] = moe_layers[0] if moe_layers else len(config.layers)
        router = config.layers[moe_layers[0]].moe.router if moe_layers else None
        if router is not None:  # DeepseekV3TopkRouter's settings (its defaults are the 671B model's)
            base["n_group"] = router.num_expert_groups or 1
            base["topk_group"] = router.num_limited_groups or 1
            base["routed_scaling_factor"] = router.route_scale
    if moe_layers:
        moe = config.layers[moe_layers[0]].moe
        experts_key = {"qwen3_moe": "num_experts", "qwen3_5_moe": "num_experts", "gpt_oss": "num_local_experts"}
        base[experts_key.get(family, "n_routed_experts")] = moe.num_experts
        base["num_experts_per_tok"] = moe.router.top_k
        base["norm_topk_prob"] = moe.router.route_norm
        if family == "gpt_oss":  # to_hf drops its experts: their width from torchtitan's config
            base["intermediate_size"] = moe.routed_experts.inner_experts.hidden_dim
            base["sliding_window"] = next(b.attention.sliding_window_size for b in config.layers)
            base["layer_types"] = [
                "full_attention" if b.attention.sliding_window_size is None else "sliding_attention"
                for b in config.layers
            ]
        expert = next((k for k in hf if ".experts.0.gate_proj.weight" in k), None)
        if expert is not None:
            base["moe_intermediate_size"] = hf[expert].shape[0]
            shared = next((k for k in hf if "shared_experts.gate_proj.weight" in k), None)
            if shared is not None:
                base["n_shared_experts"] = hf[shared].shape[0] // hf[expert].shape[0]
            shared = next((k for k in hf if "shared_expert.gate_proj.weight" in k), None)
            if shared is not None:  # Qwen3.5's one shared expert, gated
                base["shared_expert_intermediate_size"] = hf[shared].shape[0]
    if family.startswith("qwen3_5"):
        _linear_attention(base, hf, config)
    if getattr(config, "vision_encoder", None) is None:
        return base
    # A vision-language model: the language model's settings go to text_config.
    top = {k: base.pop(k) for k in ("model_type", "architectures", "tie_word_embeddings", "torch_dtype")}
    base["model_type"] = "deepseek_v3" if record.latent_attention else f"{top['model_type']}_text"
    if family == "kimi_k2_7":  # the projector's input norm is as wide as the vision tower
        top["projection_hidden_size"] = config.vision_encoder.dim
    return {
        **top,
        "text_config": base,
        "vision_config": _vision_config(family, config.vision_encoder, hf),
    }


def _rope(attention) -> dict:
    """The rotary settings in HF's words, so that transformers' forward equals torchtitan's."""
    rope = attention.rope
    if rope is None:
        return {}
    settings = {"rope_theta": rope.theta, "max_position_embeddings": rope.max_seq_len}
    if getattr(rope, "mrope_section", None):  # Qwen3.5: partial; text positions are the same on all three axes
        settings["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": rope.theta,
            "partial_rotary_factor": attention.rotary_dim / attention.head_dim,
            "mrope_section": list(rope.mrope_section),
            "mrope_interleaved": True,
        }
    if rope.scaling == "yarn":  # torchtitan folds mscale into the softmax scale only: attention_factor 1
        mscale = getattr(attention, "mscale", None)
        settings["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": rope.rope_factor,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
            "original_max_position_embeddings": rope.original_seq_len,
            "truncate": rope.truncate,
            **({"mscale": mscale, "mscale_all_dim": mscale} if mscale else {}),
        }
    if rope.scaling == "llama":
        settings["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    return settings


def _linear_attention(base: dict, hf: dict, config) -> None:
    """Qwen3.5's Gated DeltaNet sizes, from its layers' shapes."""
    layers = [block.attention is None for block in config.layers]
    base["layer_types"] = ["linear_attention" if linear else "full_attention" for linear in layers]
    if not any(layers):
        return
    first = f"model.language_model.layers.{layers.index(True)}.linear_attn."
    value_heads, value_dim = (
        hf[first + "A_log"].shape[0],
        hf[first + "norm.weight"].shape[0],
    )
    key_rows = (hf[first + "in_proj_qkv.weight"].shape[0] - value_heads * value_dim) // 2
    base.update(
        linear_num_value_heads=value_heads,
        linear_value_head_dim=value_dim,
        linear_key_head_dim=value_dim,
        linear_num_key_heads=key_rows // value_dim,
        linear_conv_kernel_dim=hf[first + "conv1d.weight"].shape[-1],
    )


def _vision_config(family: str, vision, hf: dict) -> dict:
    if family.startswith("qwen3_5"):
        return {
            "depth": vision.num_layers,
            "hidden_size": vision.dim,
            "num_heads": vision.num_heads,
            "intermediate_size": hf["model.visual.blocks.0.mlp.linear_fc1.weight"].shape[0],
            "in_channels": vision.in_channels,
            "patch_size": vision.patch_size,
            "temporal_patch_size": vision.temporal_patch_size,
            "spatial_merge_size": vision.spatial_merge_size,
            "out_hidden_size": hf["model.visual.merger.linear_fc2.weight"].shape[0],
            "num_position_embeddings": vision.num_position_embeddings,
        }
    return {  # kimi_k2_7: MoonViT
        "num_hidden_layers": vision.num_layers,
        "hidden_size": vision.dim,
        "num_attention_heads": vision.num_heads,
        "intermediate_size": hf["vision_tower.encoder.blocks.0.mlp.fc0.weight"].shape[0],
        "patch_size": vision.patch_size,
        "pos_emb_height": vision.init_pos_emb_height,
        "pos_emb_width": vision.init_pos_emb_width,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        nargs="+",
        required=True,
        help="each into OUT/<family>/",
    )
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spawn_gloo_ranks(_save_families, (str(args.out_dir), args.family), args.world_size)
    # torchtitan's forward, after the ranks have left: rank 0 computing it alone while its peer went on
    # widened gloo's teardown race (pytorch/gloo#155: "terminate called without an active exception").
    for family in set(args.family) & set(LOGITS):
        full_state = args.out_dir / family / "expected" / FULL_STATE
        _write_logits(args.out_dir / family, family, _spec(family), torch.load(full_state, weights_only=True))
        full_state.unlink()
    for family in args.family:
        print(args.out_dir / family / "checkpoint" / f"step-{STEP}")


if __name__ == "__main__":
    main(sys.argv[1:])
