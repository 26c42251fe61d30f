"""verl Megatron checkpoints of many architectures, each built through Megatron-Bridge 0.6 itself: run with
the bridge venv's python.

    .venv-bridge/bin/python merge_pipeline_samples/megatron_bridge_archs.py OUT ARCHITECTURE...

For each HF architecture (a name Megatron-Bridge registers): rank 0 saves a tiny transformers model of
it (its config class, ``AutoConfig.for_model``, with the small sizes below) into ``OUT/<arch>/hf/``; two
gloo ranks load it with ``AutoBridge.from_hf_pretrained`` and the bridge's own model provider, tensor
parallel 2 and, where the bridge's provider has experts, expert parallel 2 (expert tensor parallel 1), and save what
verl saves with the bridge and ``use_dist_checkpointing=True``: ``dist_checkpointing.save`` of the
model's ``sharded_state_dict`` into ``OUT/<arch>/actor/model/dist_ckpt/``. Rank 0 writes the bridge's
``export_hf_weights`` of the same model as ``OUT/<arch>/expected/model.safetensors``: the reference;
``OUT/<arch>/layout.txt`` says the parallel layout (``TP=2`` or ``TP=2, EP=2``).

TransformerEngine is not installed. A provider whose layer spec is the bridge's default
(``gpt_provider.default_layer_spec``: TransformerEngine's spec) is given the bridge's own
``local_layer_spec`` (megatron-core's local layers: the same parameters, a layer norm as its own
module instead of fused into the next linear, which the bridge maps under both names). A bridge that
sets a spec of its own is left with it: when that spec needs TransformerEngine, the architecture does not
build here. With ``--each`` every architecture gets ranks of its own and one that fails is recorded in
``OUT/<arch>/failed.txt`` (its error, one line) while the writer goes on: how the refusals in
``merge_pipeline/families.py`` were found.
TransformerEngine's import by two bridge modules is handled as in ``megatron_bridge_save.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Run as a script, its own folder comes first on the path, where megatron.py would hide megatron-core.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from merge_pipeline_samples.gloo_ranks import spawn_gloo_ranks  # noqa: E402  (after its path)
from merge_pipeline_samples.megatron_bridge_save import (  # noqa: E402
    _CUDA_FUSIONS,
    _fresh,
    _import_bridge,
    _patch_for_cpu,
    _write_expected,
)

# Small sizes under every name the families' config classes use for them.
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


def _hf_model(architecture: str):
    import transformers

    model_class = getattr(transformers, architecture)
    # Expert sizes only for a config class with experts: the bridge reads num_local_experts & co. from any
    # config, and some bridges read names their config class lacks (HYV3's first_k_dense_replace).
    defaults = model_class.config_class()
    moe = any(hasattr(defaults, name) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    sizes = {**_SIZES, **(_MOE_SIZES if moe else {})}
    if hasattr(defaults, "kv_lora_rank"):  # multi-latent attention: its head_dim is the rotary part (GLM-4.7-Flash)
        sizes["head_dim"] = _MOE_SIZES["qk_rope_head_dim"]
    config = model_class.config_class(**sizes, architectures=[architecture])
    torch.manual_seed(0)
    model = model_class(config).float()
    with torch.no_grad():  # norms away from their all-ones init, so a swapped norm cannot pass
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.uniform_(0.5, 1.5)
    return model


def _local_attention_takes_mla_channels() -> None:
    """megatron-core 0.18.2's multi-latent attention passes ``k_channels`` / ``v_channels`` to its core attention,
    which only TransformerEngine's takes; its local ``DotProductAttention`` raises on them. They size only the
    forward's buffers: the local class holds no parameter that depends on them (its one, ``softmax_offset``, is
    per head), so dropping them changes no saved tensor. The forward is never run here."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    init = DotProductAttention.__init__

    def without_channels(self, *args, k_channels=None, v_channels=None, **kwargs):
        init(self, *args, **kwargs)

    DotProductAttention.__init__ = without_channels


def _save_all(rank: int, world_size: int, out: str, architectures: list[str]) -> None:
    _patch_for_cpu()
    _local_attention_takes_mla_channels()
    for architecture in architectures:
        _save(rank, Path(out) / architecture, architecture, world_size)


def _save(rank: int, out: Path, architecture: str, world_size: int) -> None:
    from megatron.core import dist_checkpointing, parallel_state

    auto_bridge = _import_bridge()
    from megatron.bridge.models import gpt_provider  # after _import_bridge: it imports TransformerEngine

    if rank == 0:
        _hf_model(architecture).save_pretrained(out / "hf")
    dist.barrier()
    bridge = auto_bridge.from_hf_pretrained(str(out / "hf"), torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    moe = bool(getattr(provider, "num_moe_experts", None))
    ep = world_size if moe else 1
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=world_size, expert_model_parallel_size=ep, expert_tensor_parallel_size=1
    )
    try:
        provider.tensor_model_parallel_size = world_size
        provider.expert_model_parallel_size = ep
        provider.expert_tensor_parallel_size = 1
        provider.params_dtype = torch.float32
        provider.bf16 = provider.fp16 = False
        if moe:  # TransformerEngine's grouped linear and fused permutation: not here
            provider.moe_grouped_gemm = provider.moe_permute_fusion = provider.moe_router_fusion = False
            provider.moe_token_dispatcher_type = "allgather"  # alltoall opens a CUDA stream; saving routes nothing
            provider.moe_shared_expert_overlap = False  # only with alltoall
        if getattr(provider, "transformer_layer_spec", None) is gpt_provider.default_layer_spec:
            provider.transformer_layer_spec = gpt_provider.local_layer_spec
        for fusion in _CUDA_FUSIONS:
            setattr(provider, fusion, False)
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        role = out / "actor"
        dist_checkpointing.save(model[0].sharded_state_dict(), str(_fresh(role / "model" / "dist_ckpt")))
        if rank == 0:
            bridge.hf_pretrained.config.save_pretrained(role / "model" / "huggingface")
        exported = {name: tensor.clone() for name, tensor in bridge.export_hf_weights(model, cpu=True)}
        if rank == 0:
            _write_expected(out, exported, model[0].config, role)
            (out / "layout.txt").write_text(f"TP={world_size}" + (f", EP={ep}" if moe else "") + "\n")
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("architectures", nargs="+")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--each",
        action="store_true",
        help="ranks of their own per architecture; one that fails is recorded in OUT/<arch>/failed.txt",
    )
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if not args.each:  # one set of ranks for all: any failure fails the run
        spawn_gloo_ranks(_save_all, (str(args.out_dir), args.architectures), args.world_size)
        return
    import transformers

    for architecture in args.architectures:
        folder = args.out_dir / architecture
        if not hasattr(transformers, architecture):  # no model to build it from: no ranks needed to say so
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "failed.txt").write_text(
                f"transformers {transformers.__version__} does not ship {architecture}\n"
            )
            continue
        try:
            spawn_gloo_ranks(_save_all, (str(args.out_dir), [architecture]), args.world_size)
        except (
            mp.ProcessRaisedException,
            mp.ProcessExitedException,
        ) as exc:  # a rank's traceback (the error, then where it was raised) or its exit
            lines = str(exc).strip().splitlines()
            frames = [line.strip() for line in lines if line.strip().startswith("File ")]
            error = f"{lines[-1]} ({frames[-1].split('site-packages/')[-1]})" if frames else lines[-1]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "failed.txt").write_text(error + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
