"""Megatron-Core torch_dist checkpoints of 64 ranks (TP=8 x PP=8; TP=2 x EP=8 x PP=4 for an MoE),
saved by megatron-core's own code in one process.

One torchrun process per rank (``megatron_worker``) cannot reach 64 ranks on a small machine. Here one
process plays each rank in turn under torch's ``fake`` process group: it joins the group as rank r,
runs ``parallel_state.initialize_model_parallel`` (no gloo groups: the fake store cannot make them),
builds the rank's ``GPTModel`` with ``megatron_worker``'s layer spec and sets every local shard from
the one seeded global tensor of its checkpoint key (``megatron.global_values``, generated once for all
ranks), then saves it with the steps of ``dist_checkpointing.save`` (torch_dist, megatron's default
strategy, as verl saves):

1. ``save_preprocess`` (factories applied, common state split off; rank 0 writes ``common.pt`` with
   megatron's common strategy);
2. ``TorchDistSaveShardedStrategy``'s translation (``_replace_state_dict_keys_with_sharded_keys``,
   ``mcore_to_pyt_state_dict``), ``MCoreSavePlanner`` and ``FileSystemWriterAsync`` for the local
   plan, the decentralized global plan megatron takes by default, and the rank's ``__r_*.distcp``
   files, written by the writer's own (forked) save function;
3. after the last rank, what the collectives would have carried, passed by hand: the coordinator's
   planner makes ``.metadata`` from every rank's local plan (``gather_object`` in
   ``save_state_dict_async_plan``) and the writer's ``finish`` records every rank's write results
   (``gather_object`` in ``save_state_dict_async_finalize``); megatron's sharding check
   (``validate_sharding_integrity``, an ``all_gather_object`` of every rank's shard metadata) runs on
   the shards of all ranks; then ``metadata.json`` (``save_config``).

Under the fake group those three collectives move no data, so ``dist_checkpointing.save`` itself would
plan ``.metadata`` from rank 0's shards alone. verl wraps the strategy in ``FullyParallelSaveStrategyWrapper``
over the data-parallel group, which spreads the writing of replicated shards over that group (its own
all-gather of shard metadata); at data parallel 1 (TP=8 x PP=8) that changes nothing, and in the MoE
(data parallel 8) the first replica of each dense shard writes it, as plain ``dist_checkpointing.save``
does. No forward pass: pipeline stages need a schedule.

    python -m merge_pipeline_samples.megatron_fake_pg OUT --variant llama_tp8_pp8
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from merge_pipeline_samples.megatron import (
    MegatronSample,
    Variant,
    _hf_config,
    _write_reference,
    reference_weights,
)

VARIANTS = {
    v.name: v
    for v in (
        Variant("llama_tp8_pp8", "llama", tp=8, pp=8, size="tiny_tp8_pp8"),
        # Expert tensor parallelism follows TP (2), so EP=8 x TP=2 spans 16 ranks: data parallel 8.
        Variant("mixtral_tp2_ep8_pp4", "mixtral", tp=2, pp=4, ep=8, size="tiny_8_experts"),
        Variant("llama_250m_tp8_pp8", "llama", tp=8, pp=8, size="250m_16_layers"),
        Variant("mixtral_128_experts_tp2_ep8_pp4", "mixtral", tp=2, pp=4, ep=8, size="tiny_128_experts"),
    )
}
WORLD_SIZE = 64


def write_fake_pg_megatron(root: Path, v: Variant, world_size: int = WORLD_SIZE) -> MegatronSample:
    """Save ``v`` at ``world_size`` ranks as verl's legacy layout under ``root/<name>``
    (``actor/dist_ckpt``, ``actor/huggingface``, ``reference``)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.utils import _get_failure_dict

    from merge_pipeline_samples.megatron_worker import _patch_for_cpu, _write_transformer_config

    warnings.filterwarnings("ignore")
    _patch_for_cpu()
    sample = MegatronSample(v, root / v.name / "actor", root / v.name / "reference")
    dist_dir = sample.role_dir / "dist_ckpt"
    dist_dir.mkdir(parents=True, exist_ok=True)
    full, shards, local_plans, results, coordinator = {}, [], [], [], None
    for rank in range(world_size):
        saved = _save_rank(v, rank, world_size, dist_dir, full)
        shards.append(saved.shards)
        local_plans.append(saved.local_plan)
        results.append(saved.write_results)
        if rank == 0:
            coordinator = saved
            _write_transformer_config(saved.config, sample.role_dir / "transformer_config.json")
    _validate_sharding(shards)
    failures = _get_failure_dict(results)  # as save_state_dict_async_finalize: no .metadata after a failed write
    if failures:
        raise CheckpointException("write", failures)
    _, metadata = coordinator.planner.create_global_plan(local_plans)
    metadata.all_local_plans = local_plans  # as save_state_dict_async_plan records them
    coordinator.writer.finish(metadata, results)
    save_config(CheckpointingConfig("torch_dist", 1), str(dist_dir))

    config = _hf_config(v)
    config.save_pretrained(sample.role_dir / "huggingface")
    _write_reference(sample.reference_dir, config, reference_weights(full, v), v)
    return sample


@dataclass
class _SavedRank:
    """What one rank's save hands the collectives (and, for rank 0, the coordinator's planner and writer)."""

    config: object  # the rank's TransformerConfig, for transformer_config.json
    shards: list  # its ShardedTensors without data: validate_sharding_integrity's all_gather_object
    local_plan: object  # gather_object in save_state_dict_async_plan
    write_results: list  # gather_object in save_state_dict_async_finalize
    planner: object
    writer: object


def _save_rank(v: Variant, rank: int, world_size: int, dist_dir: Path, full: dict) -> _SavedRank:
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_common_strategy,
        get_default_save_sharded_strategy,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    from merge_pipeline_samples.megatron_worker import _build_model, _fill, _metadata, _transformer_config

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=v.tp,
            pipeline_model_parallel_size=v.pp,
            expert_model_parallel_size=v.ep,
            create_gloo_process_groups=False,
        )
        config = _transformer_config(v)
        config.perform_initialization = False  # every value is set from the global tensors below
        model = _build_model(v, config)
        _fill(model, v, full)
        # 1: dist_checkpointing.save's preprocessing; rank 0 writes common.pt
        sharded, common = save_preprocess(model.sharded_state_dict(metadata=_metadata(v)), False)
        if rank == 0:
            get_default_save_common_strategy().save_common(common, dist_dir)
        shards = [item.without_data() for item in nested_values(sharded)]
        # 2: TorchDistSaveShardedStrategy.async_save and save_state_dict_async_plan, rank by rank
        strategy = get_default_save_sharded_strategy()
        translated, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, strategy.keep_only_main_replica)
        state = mcore_to_pyt_state_dict(translated, False)
        writer = FileSystemWriterAsync(dist_dir, thread_count=strategy.thread_count)
        planner = MCoreSavePlanner(
            dedup_replicated_tensors=not strategy.keep_only_main_replica, flatten_state_dict=False
        )
        planner.set_up_planner(state, is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0)
        local_plan = writer.prepare_local_plan(planner.create_local_plan())
        plan = planner.finish_plan(
            writer.prepare_decentralized_global_plan(planner.create_decentralized_global_plan(local_plan))
        )
        writer.prepare_write_data(plan, planner)
        save, preload, arguments = writer.get_save_function_and_args()
        if save is not None:  # AsyncRequest.execute_sync, without its finalize step (3, by hand)
            arguments[1] = preload()
            save(*arguments)
        return _SavedRank(config, shards, local_plan, writer.retrieve_write_results(), planner, writer)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _validate_sharding(shards: list[list]) -> None:
    """megatron's ``validate_sharding_integrity`` on rank 0, given what its all_gather_object collects."""
    from megatron.core.dist_checkpointing.validation import validate_sharding_integrity

    dist.init_process_group("fake", rank=0, world_size=len(shards), store=FakeStore())
    try:
        validate_sharding_integrity(shards)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m merge_pipeline_samples.megatron_fake_pg",
        description="Save Megatron-Core checkpoints of 64 ranks in one process (fake process group).",
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), required=True)
    args = parser.parse_args(argv)
    for name in args.variant:
        print(write_fake_pg_megatron(args.out, VARIANTS[name]).role_dir)


if __name__ == "__main__":  # the writer's result queue is a spawned manager, which re-imports this module
    main(sys.argv[1:])
