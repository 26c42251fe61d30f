"""verl FSDP2 checkpoints at thousands of ranks, written by one process with torch's fake process group.

One OS process per rank (``fsdp.py``) cannot reach world size 1024 on one machine. torch's own
``fake`` process group lets one process play each rank in turn: it joins the group as rank r,
builds the mesh, wraps every tensor's ``torch.chunk`` piece for r in a ``DTensor`` with
``Shard(0)`` exactly as ``fully_shard`` lays it out (uneven and empty trailing shards included),
``torch.save``s the state dict as ``model_world_size_W_rank_r.pt`` and leaves the group. The
metadata beside the rank files (``fsdp_config.json``, ``huggingface/``) is ``fsdp.py``'s.

    python -m merge_pipeline.sample_checkpoints.fsdp_fake_pg OUT_ROLE_DIR --world-size 1024 [...]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from .fsdp import FsdpSpec, _causal_lm_config, _spec_from_args, _write_metadata, _write_reference
from .fsdp import _parser as _fsdp_parser


def write_fake_pg_checkpoint(role_dir: Path, spec: FsdpSpec, *, reference_dir: Path | None = None) -> None:
    """Write an FSDP2 role folder of ``spec.world_size`` rank files (1-D mesh, fp32 or bf16, no optimizer)."""
    if spec.fsdp_version != 2 or spec.mesh is not None or spec.placements is not None or spec.lora:
        raise ValueError("the fake process group writer makes FSDP2 1-D meshes without LoRA only")
    role_dir = Path(role_dir)
    role_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fsdp-fake-pg-") as scratch:
        config = _causal_lm_config(spec)
        job = _write_reference(spec, config, Path(reference_dir) if reference_dir is not None else Path(scratch))
        weights = load_file(job["weights"])
        _write_metadata(role_dir, spec, config)
        pieces = {name: torch.chunk(weights[name], spec.world_size, dim=0) for name in job["names"]}
        for rank in range(spec.world_size):
            _save_rank(role_dir, weights, pieces, rank, spec.world_size, spec.mesh_dim_names)


def _save_rank(role_dir: Path, weights: dict, pieces: dict, rank: int, world_size: int, dim_names) -> None:
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=dim_names)
        state = {}
        for name, chunks in pieces.items():
            full = weights[name]
            # torch.chunk returns fewer pieces than ranks when rows run out: those ranks hold 0 rows.
            local = chunks[rank] if rank < len(chunks) else full[full.shape[0] :]
            state[name] = DTensor.from_local(  # a copy: torch.save would store a view's whole storage
                local.clone(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
        torch.save(state, role_dir / f"model_world_size_{world_size}_rank_{rank}.pt")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = _fsdp_parser()
    parser.prog = "python -m merge_pipeline.sample_checkpoints.fsdp_fake_pg"
    parser.description = "Write a verl FSDP2 checkpoint at any world size in one process (torch's fake process group)."
    args = parser.parse_args(argv)
    spec = _spec_from_args(args, args.world_size or FsdpSpec().world_size)
    write_fake_pg_checkpoint(args.role_dir, spec, reference_dir=args.reference_dir)


if __name__ == "__main__":
    main()
