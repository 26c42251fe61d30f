"""DeepSpeed ZeRO-3 checkpoints at hundreds of ranks, saved by DeepSpeed itself in one process.

One ``torchrun`` process per rank (``deepspeed.py``) cannot reach 512 ranks on one machine. Here one
process plays each rank in turn under torch's ``fake`` process group: it joins the group as rank r,
builds the same seeded model, runs ``deepspeed.initialize`` (ZeRO-3 partitions every parameter over
all ranks: rank r keeps elements ``[r * ceil(n / W), (r + 1) * ceil(n / W))`` of each, padded) and
``engine.save_checkpoint``, then leaves the group. The fake group's collectives move no data, so
there is no training step (its gradients would be garbage): the saved weights are the seeded ones,
written to the reference folder as ``TRAINED_WEIGHTS`` before the first rank. DeepSpeed caches its
process groups in ``deepspeed.utils.groups``; they are cleared between ranks.

    python -m merge_pipeline_samples.deepspeed_fake_pg OUT_SAVE_DIR --world-size 512 \\
        [--reference-dir REF] [deepspeed.py's model flags]
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from .deepspeed import TRAINED_WEIGHTS, DeepSpeedSpec, _skip_shm_all_reduce, _write_config_files, ds_config

# deepspeed.utils.groups' module-level caches of the process groups it made for the rank before.
_CACHED_GROUPS = ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP")
_CACHED_GROUPS += ("_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP")
_CACHED_GROUPS += ("_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", "_MPU_TENSOR_MODEL_PARALLEL_RANK")
_CACHED_GROUP_TABLES = ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP")
_CACHED_GROUP_TABLES += ("_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP")
_LAUNCHER_ENVIRONMENT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def write_fake_pg_deepspeed(save_dir: Path, reference_dir: Path, spec: DeepSpeedSpec) -> None:
    """Save ``spec`` (ZeRO-3, untrained) at ``spec.world_size`` ranks into ``save_dir``; ``reference_dir``
    gets ``config.json`` and the saved weights (``TRAINED_WEIGHTS``)."""
    import deepspeed
    import transformers
    from safetensors.torch import save_file

    from .fsdp import _randomize

    if spec.stage != 3 or spec.frozen or spec.bf16 or spec.openrlhf_actor:
        raise ValueError("the fake process group writer saves plain fp32 ZeRO-3 models only")
    save_dir, reference_dir = Path(save_dir), Path(reference_dir)
    _write_config_files(save_dir, reference_dir, spec)
    _skip_shm_all_reduce()
    config = transformers.AutoConfig.from_pretrained(reference_dir)

    def model() -> torch.nn.Module:
        built = transformers.AutoModelForCausalLM.from_config(config)
        _randomize(built, spec.seed)
        return built

    state = model().state_dict()  # tied parameters saved under each name, as deepspeed.py's reference
    save_file({name: t.detach().clone() for name, t in state.items()}, reference_dir / TRAINED_WEIGHTS)
    # DeepSpeed calls gc.collect() for every rank; frozen, the objects made so far are not walked again.
    gc.collect()
    gc.freeze()
    launcher_environment = {name: os.environ.get(name) for name in _LAUNCHER_ENVIRONMENT}
    try:
        for rank in range(spec.world_size):
            # deepspeed.initialize asks for a launcher's environment.
            os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(spec.world_size), LOCAL_WORLD_SIZE="1")
            dist.init_process_group("fake", rank=rank, world_size=spec.world_size, store=FakeStore())
            try:
                deepspeed.init_distributed("fake")
                module = model()
                engine, *_ = deepspeed.initialize(
                    model=module, model_parameters=list(module.parameters()), config=ds_config(spec)
                )
                engine.save_checkpoint(str(save_dir))
                del engine, module
            finally:
                dist.destroy_process_group()
                _forget_deepspeed_groups()
    finally:  # a merge this process starts next must not believe torchrun started it
        for name, value in launcher_environment.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        gc.unfreeze()


def _forget_deepspeed_groups() -> None:
    from deepspeed.utils import groups

    for name in _CACHED_GROUPS:
        setattr(groups, name, None)
    for name in _CACHED_GROUP_TABLES:
        setattr(groups, name, {})


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m merge_pipeline_samples.deepspeed_fake_pg",
        description="Save a DeepSpeed ZeRO-3 checkpoint at any world size in one process (fake process group).",
    )
    defaults = DeepSpeedSpec()
    parser.add_argument("save_dir", type=Path, help="the folder engine.save_checkpoint writes (gets `latest`)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--reference-dir", type=Path, help="default: SAVE_DIR/../reference")
    for flag in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "num_layers"):
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=getattr(defaults, flag))
    for flag in ("intermediate_size", "vocab_size"):
        parser.add_argument("--" + flag.replace("_", "-"), type=int, default=getattr(defaults, flag))
    args = parser.parse_args(argv)
    fields = ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "num_layers")
    fields += ("intermediate_size", "vocab_size")
    spec = DeepSpeedSpec(stage=3, world_size=args.world_size, **{f: getattr(args, f) for f in fields})
    write_fake_pg_deepspeed(args.save_dir, args.reference_dir or args.save_dir.parent / "reference", spec)


if __name__ == "__main__":
    main()
