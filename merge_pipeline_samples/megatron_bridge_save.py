"""A verl Megatron checkpoint written through Megatron-Bridge 0.6 itself: run with the bridge venv's python.

    .venv-bridge/bin/python merge_pipeline_samples/megatron_bridge_save.py OUT

``scripts/setup_bridge.sh`` builds that venv (megatron-core 0.18 and Megatron-Bridge 0.6, whose
wheels say Python 3.12, installed on 3.11 without their dependencies), so this file imports only
torch, transformers, safetensors, megatron-core and Megatron-Bridge. Rank 0 saves a small transformers
model (``OUT/<family>/hf/``); two gloo ranks load it with ``AutoBridge.from_hf_pretrained`` and the
bridge's own model provider (tensor parallel 2, megatron-core's local layer spec: TransformerEngine
is not installed) and save what verl's ``MegatronCheckpointManager`` saves with the bridge and
``use_dist_checkpointing=True`` into ``OUT/<family>/actor/``: ``model/dist_ckpt/`` (megatron-core
``dist_checkpointing.save`` of the model's ``sharded_state_dict``, as verl's
``save_dist_checkpointing``), ``model/huggingface/`` (the HF config, then the bridge's
``save_hf_weights``) and ``transformer_config.json``. Rank 0 writes what the bridge's
``export_hf_weights`` gives as ``OUT/<family>/expected/model.safetensors``.

Megatron-Bridge imports TransformerEngine unconditionally in two modules only
(``peft/lora_layers.py``: ``import transformer_engine.pytorch as te``, used when a layer is a TE
layer; ``models/gpt_full_te_layer_autocast_spec.py``: ``from transformer_engine.pytorch import
TransformerLayer``, a base class of a TE-only spec). Only while those two modules execute, an empty
``transformer_engine.pytorch`` stands in (``TransformerLayer`` an empty ``torch.nn.Module``, any other
name an empty class that nothing is an instance of, and so are its attributes); it is removed again at once, so megatron-core
still finds no TransformerEngine and builds its local layers. The bridge's LoRA is told the same
(``peft.utils.HAVE_TE = False``): its own check takes megatron-core's ``None`` placeholders for TE classes.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script, its own folder comes first on the path, where megatron.py would hide megatron-core:
# the repository's root takes its place.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from merge_pipeline_samples.gloo_ranks import spawn_gloo_ranks  # noqa: E402  (after its path)

FAMILIES = ("llama", "qwen3")
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
_TE_IMPORTERS = ("megatron.bridge.peft.lora_layers", "megatron.bridge.models.gpt_full_te_layer_autocast_spec")
_TE_PRELOADS = (  # what those two import from megatron-core: imported first, with no TransformerEngine
    "megatron.core.tensor_parallel",
    "megatron.core.fusions.fused_layer_norm",
    "megatron.core.transformer.cuda_graphs",
    "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.moe.moe_utils",
)


class _Absent(type):
    """An empty class whose every attribute is another (``te.ops.Sequential``): nothing is an instance."""

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(name, (), {})


def _te_stub() -> dict[str, types.ModuleType]:
    top, pytorch = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.pytorch")
    pytorch.TransformerLayer = type("TransformerLayer", (torch.nn.Module,), {})
    pytorch.__getattr__ = lambda name: _Absent(name, (), {})  # te.Linear, te.ops.Sequential, ...
    top.pytorch = pytorch
    return {"transformer_engine": top, "transformer_engine.pytorch": pytorch}


class _StubTransformerEngineWhileLoading(importlib.abc.MetaPathFinder):
    """The empty TransformerEngine, visible only while the two Bridge modules above execute."""

    def find_spec(self, name, path, target=None):
        if name not in _TE_IMPORTERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = _WithStub(spec.loader)
        return spec


class _WithStub(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        stub = _te_stub()
        sys.modules.update(stub)
        try:
            self.loader.exec_module(module)
        finally:
            for name in stub:
                sys.modules.pop(name, None)


def _import_bridge():
    for name in _TE_PRELOADS:
        importlib.import_module(name)
    sys.meta_path.insert(0, _StubTransformerEngineWhileLoading())
    from megatron.bridge import AutoBridge
    from megatron.bridge.peft import utils as peft_utils

    # Its LoRA finds TransformerEngine when megatron-core's TE names import, and without TE megatron-core
    # 0.18 binds some of them to None (TEColumnParallelGroupedLinear): say what is true here.
    peft_utils.HAVE_TE = False
    return AutoBridge


def _patch_for_cpu() -> None:
    # dist_checkpointing and the model provider call these; there is no CUDA here.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self


def _hf_model(family: str):
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "llama":
        config = transformers.LlamaConfig(**common, architectures=["LlamaForCausalLM"])
        model_class = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen3Config(**common, head_dim=16, architectures=["Qwen3ForCausalLM"])
        model_class = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = model_class(config).float()
    with torch.no_grad():  # norms away from their all-ones init, so a swapped norm cannot pass
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model


def _save_families(rank: int, world_size: int, out: str, families: list[str]) -> None:
    _patch_for_cpu()
    for family in families:
        _save(rank, Path(out) / family, family, world_size)


def _save(rank: int, out: Path, family: str, world_size: int) -> None:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    auto_bridge = _import_bridge()
    if rank == 0:
        _hf_model(family).save_pretrained(out / "hf")
    dist.barrier()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    try:
        bridge = auto_bridge.from_hf_pretrained(str(out / "hf"), torch_dtype=torch.float32)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size = world_size
        provider.params_dtype = torch.float32
        provider.bf16 = provider.fp16 = False
        provider.transformer_layer_spec = get_gpt_layer_local_spec(
            normalization="RMSNorm", qk_layernorm=family == "qwen3"
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
        bridge.save_hf_weights(model, str(role / "model" / "huggingface"))
        exported = {name: tensor.clone() for name, tensor in bridge.export_hf_weights(model, cpu=True)}
        if rank == 0:
            _write_expected(out, exported, model[0].config, role)
        dist.barrier()
        if family == LORA_FAMILY:
            _save_lora(bridge, model, out / "lora", rank)
    finally:
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
    parser.add_argument("--family", choices=FAMILIES, nargs="+", default=list(FAMILIES))
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spawn_gloo_ranks(_save_families, (str(args.out_dir), args.family), args.world_size)
    for family in args.family:
        print(args.out_dir / family / "actor")


if __name__ == "__main__":
    main(sys.argv[1:])
