"""DCP folders at thousands of ranks, written by torch's own DCP save code in one process.

``dcp.save`` under torch's ``fake`` process group cannot write them: its collectives move no data,
so the coordinator's gathered plans hold only its own chunks and ``DefaultSavePlanner`` refuses the
global plan ("Failed to validate global plan ... invalid fill"). This writer runs exactly the steps
of torch's ``_save_state_dict`` with torch's own ``DefaultSavePlanner`` and ``FileSystemWriter``
and only the two collectives replaced by passing the values between the ranks it plays in turn:

1. each rank r joins the fake group as r, wraps its ``torch.chunk`` rows of every tensor in a
   ``Shard(0)`` DTensor (as ``fully_shard`` lays them out, uneven and empty trailing shards included)
   and makes its local plan (``set_up_planner``, ``create_local_plan``, ``prepare_local_plan``);
2. the coordinator's planner and writer make the global plan and metadata from all local plans
   (``create_global_plan``, ``prepare_global_plan``: the gather torch does with ``reduce_scatter``);
3. each rank writes its ``__r_0.distcp`` from its part of the global plan (``finish_plan``,
   ``write_data``);
4. the coordinator writes ``.metadata`` from every rank's write results (``finish``: torch's
   ``all_reduce``).

The state dict is what the trainer hands ``dcp.save``: torchtitan's flat model keys (its names, q/k
rows in its rotary layout: ``dcp._torchtitan_weights``) or accelerate's ``{"model": ...}``.

    python -m merge_pipeline_samples.dcp_fake_pg OUT_DIR --source torchtitan --world-size 1024 \\
        --reference-dir REF [--hidden-size ... fsdp.py's model flags]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from .dcp import MODEL_DIRS, _torchtitan_weights
from .fsdp import FsdpSpec, _causal_lm_config, _write_reference

SOURCES = ("torchtitan", "accelerate")


def write_fake_pg_dcp(out_dir: Path, source: str, model: FsdpSpec, *, reference_dir: Path) -> Path:
    """Write ``source``'s DCP folder of ``model.world_size`` ranks into ``out_dir`` and the original HF
    model into ``reference_dir``; returns the folder holding ``.metadata``."""
    from .tokenizer import write_tokenizer

    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, not {source!r}")
    out_dir, reference_dir = Path(out_dir), Path(reference_dir)
    dcp_dir = out_dir / MODEL_DIRS[source]
    dcp_dir.mkdir(parents=True, exist_ok=True)
    config = _causal_lm_config(model)
    job = _write_reference(model, config, reference_dir)
    write_tokenizer(reference_dir, vocab_size=model.vocab_size)
    with tempfile.TemporaryDirectory(prefix="dcp-fake-pg-") as scratch:
        if source == "torchtitan":
            job = _torchtitan_weights(job, config, Path(scratch) / "torchtitan.safetensors")
        weights = load_file(job["weights"])
        pieces = {name: torch.chunk(weights[name], model.world_size, dim=0) for name in job["names"]}
        _save(dcp_dir, source, weights, pieces, model.world_size)
    return dcp_dir


def _save(dcp_dir: Path, source: str, weights: dict, pieces: dict, world_size: int) -> None:
    local_plans, coordinator = [], None
    for rank in range(world_size):  # 1: every rank's local plan
        with _as_rank(rank, world_size) as mesh:
            planner, writer = _set_up(dcp_dir, _state_dict(source, weights, pieces, rank, mesh), rank)
            local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
            if rank == 0:
                coordinator = planner, writer
    planner, writer = coordinator
    global_plans, metadata = planner.create_global_plan(local_plans)  # 2: the coordinator's global plan
    global_plans = writer.prepare_global_plan(global_plans)
    results = []
    for rank in range(world_size):  # 3: every rank writes its part
        with _as_rank(rank, world_size) as mesh:
            rank_planner, rank_writer = _set_up(dcp_dir, _state_dict(source, weights, pieces, rank, mesh), rank)
            rank_writer.prepare_local_plan(rank_planner.create_local_plan())
            writes = rank_writer.write_data(rank_planner.finish_plan(global_plans[rank]), rank_planner)
            writes.wait()
            results.append(writes.value())
    writer.finish(metadata=metadata, results=results)  # 4: .metadata, last, as the coordinator does


def _set_up(dcp_dir: Path, state_dict: dict, rank: int) -> tuple[DefaultSavePlanner, FileSystemWriter]:
    """Rank ``rank``'s planner and writer, set up as ``_save_state_dict``'s ``local_step`` does."""
    planner, writer = DefaultSavePlanner(), FileSystemWriter(dcp_dir)
    writer.reset(dcp_dir)
    planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    return planner, writer


class _as_rank:
    """Join the fake process group as ``rank`` and build the 1-D mesh; leave it on exit."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def __enter__(self):
        dist.init_process_group("fake", rank=self.rank, world_size=self.world_size, store=FakeStore())
        return init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("dp_shard",))

    def __exit__(self, *exc):
        dist.destroy_process_group()


def _state_dict(source: str, weights: dict, pieces: dict, rank: int, mesh) -> dict:
    state = {}
    for name, chunks in pieces.items():
        full = weights[name]
        # torch.chunk returns fewer pieces than ranks when rows run out: those ranks hold 0 rows.
        local = chunks[rank] if rank < len(chunks) else full[full.shape[0] :]
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
        )
    return {"model": state} if source == "accelerate" else state


def main(argv: list[str] | None = None) -> None:
    from .fsdp import _parser, _spec_from_args

    parser = _parser()
    parser.prog = "python -m merge_pipeline_samples.dcp_fake_pg"
    parser.description = (
        "Write a DCP folder at any world size in one process (torch's DCP save steps, fake process group)."
    )
    parser.add_argument("--source", choices=SOURCES, required=True)
    parser.set_defaults(arch="llama")  # the torchtitan names are its Llama's
    args = parser.parse_args(argv)
    if args.reference_dir is None:
        parser.error("--reference-dir is required: the original HF model folder to write")
    spec = _spec_from_args(args, args.world_size or FsdpSpec().world_size)
    print(write_fake_pg_dcp(args.role_dir, args.source, spec, reference_dir=args.reference_dir))


if __name__ == "__main__":
    main()
