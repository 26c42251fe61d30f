"""verl FSDP2 checkpoints at thousands of ranks, written by one process with torch's fake process group.

One OS process per rank (``fsdp.py``) cannot reach world size 1024 on one machine. torch's own
``fake`` process group lets one process play each rank in turn: it joins the group as rank r,
builds the mesh, wraps every tensor's ``torch.chunk`` piece for r in a ``DTensor`` with
``Shard(0)`` exactly as ``fully_shard`` lays it out (uneven and empty trailing shards included),
``torch.save``s the state dict as ``model_world_size_W_rank_r.pt`` and leaves the group. The
metadata beside the rank files (``fsdp_config.json``, ``huggingface/``) is ``fsdp.py``'s.

    python -m merge_pipeline_samples.fsdp_fake_pg OUT_ROLE_DIR --world-size 1024 [...]
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


def write_generated_checkpoint(role_dir: Path, spec: FsdpSpec) -> None:
    """The same role folder for a model larger than memory: no tensor is ever whole. Rank r's rows of
    each tensor (its ``torch.chunk`` piece) are drawn when rank r is saved, from a generator seeded by
    (``spec.seed``, the tensor's index, r), so memory holds one rank file's share of the model. The full
    tensor is the concatenation of its ranks' pieces (``generated_tensor``). No reference folder."""
    import transformers

    if spec.fsdp_version != 2 or spec.mesh is not None or spec.placements is not None or spec.lora:
        raise ValueError("the generated writer makes FSDP2 1-D meshes without LoRA only")
    role_dir = Path(role_dir)
    role_dir.mkdir(parents=True, exist_ok=True)
    config = _causal_lm_config(spec)
    _write_metadata(role_dir, spec, config)
    with torch.device("meta"):  # names, shapes and strides only
        shapes = transformers.AutoModelForCausalLM.from_config(config, dtype=spec.dtype).state_dict()
    for rank in range(spec.world_size):
        pieces = {name: _GeneratedPieces(spec, index, full) for index, (name, full) in enumerate(shapes.items())}
        _save_rank(role_dir, shapes, pieces, rank, spec.world_size, spec.mesh_dim_names)


def generated_tensor(spec: FsdpSpec, index: int, full: torch.Tensor) -> torch.Tensor:
    """The whole tensor ``write_generated_checkpoint`` wrote as the ``index``-th of the model (``full``:
    its shape and dtype, e.g. on the meta device), to check a merge against."""
    return torch.cat(list(_GeneratedPieces(spec, index, full)))


class _GeneratedPieces:
    """``torch.chunk(full, world_size)``'s pieces, each drawn when asked for; a rank past the last piece
    gets 0 rows, as ``_save_rank`` expects."""

    def __init__(self, spec: FsdpSpec, index: int, full: torch.Tensor):
        self.spec, self.index, self.full = spec, index, full
        self.rows = -(-full.shape[0] // spec.world_size)  # torch.chunk's piece size

    def __len__(self) -> int:
        return self.spec.world_size

    def __getitem__(self, rank: int) -> torch.Tensor:
        if not 0 <= rank < len(self):
            raise IndexError(rank)
        start = min(rank * self.rows, self.full.shape[0])
        shape = (min(self.rows, self.full.shape[0] - start), *self.full.shape[1:])
        generator = torch.Generator().manual_seed((self.spec.seed * 1_000_003 + self.index) * 65_537 + rank)
        return (torch.randn(shape, generator=generator) * 0.02).to(self.full.dtype)


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
    parser.prog = "python -m merge_pipeline_samples.fsdp_fake_pg"
    parser.description = "Write a verl FSDP2 checkpoint at any world size in one process (torch's fake process group)."
    args = parser.parse_args(argv)
    spec = _spec_from_args(args, args.world_size or FsdpSpec().world_size)
    write_fake_pg_checkpoint(args.role_dir, spec, reference_dir=args.reference_dir)


if __name__ == "__main__":
    main()
