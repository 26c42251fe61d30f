"""A Megatron-FSDP role folder as verl writes it (``use_megatron_fsdp``), with reference weights.

verl saves one torch.distributed.checkpoint of DTensors (model, optimizer and RNG state together) into
``<role>/model/dist_ckpt/`` (no megatron-core ``metadata.json``). The model state dict sits under
``model.``, one key per layer, and megatron-core's ``handle_swiglu_in_state_dict`` splits a gated
``linear_fc1.weight`` into ``linear_fc1.weight_w`` (gate) and ``linear_fc1.weight_v`` (up). Every tensor
is sharded by rows over the ranks of a 1-D mesh the way ``torch.chunk`` splits it, so sizes that do
not divide give uneven shards (64 rows over 3 ranks: 22 + 21 + 21).

The ranks run under torchrun with gloo on CPU; the rest of the v2 tree (manifest, empty optimizer/
and extra/ folders) is laid out as for ``use_dist_checkpointing`` without ``hf_model``: no HF files in
the checkpoint, config and tokenizer in ``<out>/<name>/hf_model/``.

    python -m merge_pipeline.sample_checkpoints.megatron_fsdp OUT [--ranks-per-job W]
"""

from __future__ import annotations

import datetime
import re
import sys
from pathlib import Path

import torch

from merge_pipeline.sample_checkpoints.megatron import (
    MegatronSample,
    Variant,
    _finish_v2,
    _handmade_weights,
    _hf_config,
    _write_reference,
    reference_weights,
    run_torchrun_job,
)

VARIANT = Variant("qwen2_megatron_fsdp", "qwen2")


def megatron_fsdp_state(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked megatron-core tensors -> the Megatron-FSDP model state dict, as DCP keys."""
    state = {}
    for key, tensor in full.items():
        layered = re.fullmatch(r"decoder\.layers\.(.+)", key)
        if not layered:
            state[f"model.{key}"] = tensor
            continue
        for i, layer in enumerate(tensor):
            name = f"model.decoder.layers.{i}.{layered[1]}"
            if name.endswith(".mlp.linear_fc1.weight"):
                state[f"{name}_w"], state[f"{name}_v"] = layer.chunk(2, dim=0)
            else:
                state[name] = layer
    return state


def write_megatron_fsdp_sample(root: Path, *, world_size: int = 3, timeout: float = 300) -> MegatronSample:
    v = VARIANT
    out = root / v.name
    sample = MegatronSample(v, out / "actor", out / "reference", out / "hf_model")
    full = _handmade_weights(v)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(megatron_fsdp_state(full), out / "model_state.pt")
    job = {
        "state": str(out / "model_state.pt"),
        "dist_dir": str(sample.role_dir / "model" / "dist_ckpt"),
        "timeout": int(timeout),
    }
    run_torchrun_job(out, "merge_pipeline.sample_checkpoints.megatron_fsdp", job, nproc=world_size, timeout=timeout)
    (out / "model_state.pt").unlink()
    config = _hf_config(v)
    config.save_pretrained(sample.original_dir)
    from merge_pipeline.sample_checkpoints.tokenizer import write_tokenizer

    write_tokenizer(sample.original_dir, vocab_size=v.sizes["vocab"])
    _write_reference(sample.reference_dir, config, reference_weights(full, v), v)
    _finish_v2(sample.role_dir, "dist", v)
    return sample


def _rank_main(job_path: Path) -> None:
    """One rank: its row chunk of every tensor as a DTensor, Adam moments alike, and its RNG state."""
    import json

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    job = json.loads(job_path.read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=job["timeout"]))
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))

        def sharded(tensor: torch.Tensor) -> DTensor:
            chunks = torch.chunk(tensor, world_size, dim=0)
            local = chunks[rank] if rank < len(chunks) else tensor[:0]
            return DTensor.from_local(
                local.clone(), mesh, [Shard(0)], run_check=False, shape=tensor.shape, stride=tensor.stride()
            )

        model = torch.load(job["state"], weights_only=True)
        state = {key: sharded(t) for key, t in model.items()}
        for key, t in model.items():
            state[f"optimizer.state.{key.removeprefix('model.')}.exp_avg"] = sharded(
                torch.zeros_like(t, dtype=torch.float32)
            )
        state[f"rng_state.(0, {rank}).0.torch_rng_state"] = torch.get_rng_state()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(job["dist_dir"]))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m merge_pipeline.sample_checkpoints.megatron_fsdp", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--world-size", type=int, default=3)
    args = parser.parse_args(argv)
    sample = write_megatron_fsdp_sample(args.out, world_size=args.world_size)
    print(f"{sample.role_dir} (original model: {sample.original_dir}; reference: {sample.reference_dir})")


if __name__ == "__main__":
    # torchrun starts each rank with the job file; a person starts the writer with an output folder.
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        _rank_main(Path(sys.argv[1]))
    else:
        main()
