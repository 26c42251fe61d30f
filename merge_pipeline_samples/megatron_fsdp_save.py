"""A verl Megatron-FSDP checkpoint (``use_megatron_fsdp``) written by Megatron-FSDP itself: run with the
bridge venv's python.

    .venv-bridge/bin/python merge_pipeline_samples/megatron_fsdp_save.py OUT [--world-size 3]

What verl 0.9.1 runs, on megatron-core 0.18.2 (whose Megatron-FSDP is its bundled copy of megatron-fsdp
0.5.1) and Megatron-Bridge 0.6.2, the venv ``scripts/setup_bridge.sh`` builds. Rank 0 saves a small
transformers Qwen3 (``OUT/hf/``, the reference: fp32, so the bridge's import of it is exact); the gloo
ranks load it with ``AutoBridge.from_hf_pretrained`` and the bridge's model provider, wrapped as verl's
``make_megatron_module`` wraps it with ``use_megatron_fsdp``: ``provide_distributed_model`` with
``use_megatron_fsdp=True`` and the DDP config of the bridge's ``create_ddp_config`` (``optim_grads_params``,
so megatron-core's ``FullyShardedDataParallel`` / ``MegatronFSDP`` shards every parameter over all ranks).
Then verl's ``_save_megatron_fsdp_checkpoint``: ``{"model": model.state_dict_for_save_checkpoint(),
"rng_state": ...}`` through the bridge's ``save_fsdp_dtensor_checkpoint`` into
``OUT/actor/model/dist_ckpt/``. The rest of verl's role folder (manifest, empty folders) is laid out by
the test with ``merge_pipeline_samples.megatron``, which needs our venv.

What stands in for what is missing here, and why:
- CUDA (CPU-only torch): the CUDA calls the wrapping makes (current device, side streams, cache) are
  no-ops, megatron-core's ``FullyShardedDataParallel`` is given ``device=cpu`` (it defaults to
  ``cuda:<current>``) and its device meshes are CPU meshes (it asks for ``"cuda"``).
- ``megatron.bridge.training.checkpointing`` imports the whole training stack (datasets, energon, PIL,
  tensorboard, wandb...), not installed: its own source of ``save_fsdp_dtensor_checkpoint`` and
  ``preprocess_fsdp_dtensor_state_dict`` is read from the installed file and run with the megatron-core
  functions that module imports (SwiGLU split, uneven-DTensor metadata, then ``dcp.save``).
- The standalone megatron-fsdp 0.6.1 from the registry cannot wrap a megatron-core model we can run:
  with megatron-core importable it takes megatron-core's ``DistributedDataParallelConfig``, which
  rejects its arguments (``TypeError: DistributedDataParallelConfig.__init__() got an unexpected keyword
  argument``: ``'fsdp_db_use_persist_buf_on_alloc_fail'`` on 0.16.1,
  ``'megatron_fsdp_max_pool_double_buffer'`` on 0.18.2); verl does not use it either (it wraps through
  megatron-core's bundled copy).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Run as a script, its own folder comes first on the path, where megatron.py would hide megatron-core:
# the repository's root takes its place.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from merge_pipeline_samples.gloo_ranks import spawn_gloo_ranks  # noqa: E402  (after its path)
from merge_pipeline_samples.megatron_bridge_save import (  # noqa: E402
    _CUDA_FUSIONS,
    _hf_model,
    _import_bridge,
    _patch_for_cpu,
)

FAMILY = "qwen3"
_BRIDGE_SAVE = (
    "save_fsdp_dtensor_checkpoint",
    "preprocess_fsdp_dtensor_state_dict",
    "_create_fsdp_dtensor_storage_writer",
)


class _NoStream:
    """A CUDA stream that orders nothing: on CPU every operation is already in order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass


def _patch_fsdp_for_cpu() -> None:
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from torch.distributed.device_mesh import DeviceMesh

    torch.cuda.current_device = lambda: 0  # only compared with the device given below
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda *args, **kwargs: _NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None
    from_group = DeviceMesh.from_group
    DeviceMesh.from_group = staticmethod(lambda group, device_type, *a, **k: from_group(group, "cpu", *a, **k))
    wrap = mcore_fsdp_adapter.FullyShardedDataParallel.__init__
    mcore_fsdp_adapter.FullyShardedDataParallel.__init__ = lambda self, *a, device=None, **k: wrap(
        self, *a, device=torch.device("cpu"), **k
    )


def _bridge_save_fsdp_dtensor_checkpoint():
    """The bridge's ``save_fsdp_dtensor_checkpoint``, compiled from its installed source with the
    names its module imports (the module itself does not import here: see the docstring)."""
    import importlib.util

    import torch.nn.functional as F
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.msc_utils import MultiStorageClientFeature
    from megatron.core.transformer import MegatronModule
    from megatron.core.transformer import fsdp_dtensor_checkpoint as mcore

    path = Path(importlib.util.find_spec("megatron.bridge").submodule_search_locations[0]) / "training/checkpointing.py"
    tree = ast.parse(path.read_text(), str(path))
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in _BRIDGE_SAVE]
    assert len(functions) == len(_BRIDGE_SAVE), f"{path}: not Megatron-Bridge 0.6's save_fsdp_dtensor_checkpoint"
    names = dict(
        Any=object,
        Path=Path,
        torch=torch,
        F=F,
        MegatronModule=MegatronModule,
        MultiStorageClientFeature=MultiStorageClientFeature,
        HAVE_MEGATRON_FSDP=True,
        handle_fp8_extra_state_case=mcore.handle_fp8_extra_state_case,
        handle_swiglu_in_state_dict=mcore.handle_swiglu_in_state_dict,
        handle_gdn_in_state_dict=getattr(mcore, "handle_gdn_in_state_dict", None),
        handle_experts_in_state_dict=mcore.handle_experts_in_state_dict,
        preprocess_state_dict_for_uneven_dtensor=preprocess_state_dict_for_uneven_dtensor,
    )
    exec(compile(ast.Module(functions, type_ignores=[]), str(path), "exec"), names)
    return names["save_fsdp_dtensor_checkpoint"]


def _save(rank: int, world_size: int, out: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    _patch_for_cpu()
    _patch_fsdp_for_cpu()
    auto_bridge = _import_bridge()
    out = Path(out)
    if rank == 0:
        _hf_model("Qwen3ForCausalLM").save_pretrained(out / "hf")
    dist.barrier()
    parallel_state.initialize_model_parallel()
    try:
        bridge = auto_bridge.from_hf_pretrained(str(out / "hf"), torch_dtype=torch.float32)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.params_dtype = torch.float32
        provider.bf16 = provider.fp16 = False
        provider.transformer_layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True)
        for fusion in _CUDA_FUSIONS:  # kernels of TransformerEngine / apex: none on CPU
            setattr(provider, fusion, False)
        provider.finalize()
        # megatron.bridge.training.utils.config_utils.create_ddp_config(use_megatron_fsdp=True), as verl
        # calls it (that module imports the training stack too).
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True,
            check_for_nan_in_grad=True,
            use_megatron_fsdp=True,
            data_parallel_sharding_strategy="optim_grads_params",
            overlap_grad_reduce=True,
        )
        model = provider.provide_distributed_model(
            wrap_with_ddp=True, ddp_config=ddp_config, use_megatron_fsdp=True, use_cpu_initialization=True
        )
        # verl's _save_megatron_fsdp_checkpoint with save_contents model + extra. verl passes
        # model[0].module (MegatronFSDP) as ``model``, which megatron-core's SwiGLU split cannot use
        # ("GPTModel has no attribute `module`"): model[0] as the bridge's own trainer passes it.
        state_dict = {
            "model": model[0].state_dict_for_save_checkpoint(),
            "rng_state": {"(0, 0)": [{"torch_rng_state": torch.get_rng_state()}]},
        }
        save = _bridge_save_fsdp_dtensor_checkpoint()
        save(out / "actor" / "model" / "dist_ckpt", state_dict, cfg=provider, model=model[0])
    finally:
        parallel_state.destroy_model_parallel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--world-size", type=int, default=3)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spawn_gloo_ranks(_save, (str(args.out_dir),), args.world_size)
    print(args.out_dir / "actor")


if __name__ == "__main__":
    main(sys.argv[1:])
