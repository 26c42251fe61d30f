"""A NeMo-Automodel 0.7 checkpoint written by NeMo-Automodel itself: run with the nemo venv's python.

    .venv-nemo/bin/python merge_pipeline_samples/nemo_automodel_save.py OUT

``scripts/setup_nemo.sh`` builds that venv (NeMo-Automodel pins transformers 5.18 and its own
dependencies), so this file imports only torch, transformers, safetensors and nemo_automodel. Two gloo
ranks build the same small transformers Llama, ``fully_shard`` every layer and the model (Automodel's
FSDP2 manager calls the same API) and save with NeMo-Automodel's own ``Checkpointer.save_model`` and
``save_optimizer`` as its recipes do, into ``OUT/<format>/epoch_0_step_1/{model,optim}/``:

- ``safetensors``: its sharded HF storage (``model/shard-0000r-model-0000k-of-0000N.safetensors``,
  ``model/.hf_metadata/fqn_to_file_index_mapping.json``) and, with ``save_consolidated``, its
  consolidated HF folder ``model/consolidated/``;
- ``torch_save``: plain DCP (``model/.metadata``, ``__r_0.distcp``).

The same model is then saved as NeMo-RL 0.6's Automodel-based policy saves it (through these same
calls) into ``OUT/nemo_rl/step_1/policy/{weights,optimizer}/``.

Rank 0 writes the model's own state dict as ``OUT/expected/model.safetensors`` (what a merge must
equal, bit for bit) and its config as ``OUT/hf/config.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# Run as a script, its own folder comes first on the path (where megatron.py would hide megatron-core
# from an optional import): the repository's root takes its place.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from merge_pipeline_samples.gloo_ranks import spawn_gloo_ranks  # noqa: E402  (after its path)

FORMATS = ("safetensors", "torch_save")
WEIGHTS = "epoch_0_step_1"  # the folder its recipes save each step into
NEMO_RL_STEP = "step_1"


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _save(rank: int, world_size: int, out_dir: str) -> None:
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = Path(out_dir)
    model = _model()
    if rank == 0:
        _write_expected(out, model)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for save_format in FORMATS:
        config = CheckpointingConfig(
            checkpoint_dir=str(out / save_format),
            model_save_format=save_format,
            save_consolidated="every" if save_format == "safetensors" else False,
            model_cache_dir=str(out / "hf_cache"),  # no hub snapshot: its size-based shard mapping
            model_repo_id=None,
            is_peft=False,
        )
        checkpointer = Checkpointer(config, dp_rank=rank, tp_rank=0, pp_rank=0)
        weights = str(out / save_format / WEIGHTS)
        checkpointer.save_model(model, weights)
        checkpointer.save_optimizer(optimizer, model, weights)
        checkpointer.close()
    _save_as_nemo_rl(model, optimizer, rank, out)


def _save_as_nemo_rl(model, optimizer, rank: int, out: Path) -> None:
    """NeMo-RL's DTensor v2 policy (nemo_rl/models/automodel/checkpoint.py at NeMo-RL 7ea279a, 0.6.0):
    its AutomodelCheckpointManager builds this config and calls these two saves, into
    ``step_N/policy/weights`` and ``step_N/policy/optimizer``. NeMo-RL itself is not on the registry
    (``nemo-rl`` 0.0.0 is an empty placeholder), so its calls are made here as it makes them."""
    from nemo_automodel.components.checkpoint.checkpointing import Checkpointer
    from nemo_automodel.components.checkpoint.config import CheckpointingConfig

    config = CheckpointingConfig(
        enabled=True,
        checkpoint_dir=str(out / "nemo_rl"),
        model_save_format="safetensors",
        model_cache_dir="",
        model_repo_id="",
        save_consolidated=False,
        is_peft=False,
        is_async=False,
        dequantize_base_checkpoint=False,
        skip_task_head_prefixes_for_base_model=None,
    )
    checkpointer = Checkpointer(config, dp_rank=rank, tp_rank=0, pp_rank=0)
    policy = out / "nemo_rl" / NEMO_RL_STEP / "policy"
    checkpointer.save_model(model=model, weights_path=str(policy / "weights"), peft_config=None, tokenizer=None)
    checkpointer.save_optimizer(
        optimizer=optimizer, model=model, weights_path=str(policy / "optimizer"), scheduler=None
    )
    checkpointer.close()


def _write_expected(out: Path, model) -> None:
    from safetensors.torch import save_file

    (out / "expected").mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
        str(out / "expected" / "model.safetensors"),
    )
    model.config.save_pretrained(out / "hf")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    spawn_gloo_ranks(_save, (str(args.out_dir),), args.world_size)
    for save_format in FORMATS:
        print(args.out_dir / save_format / WEIGHTS)
    print(args.out_dir / "nemo_rl" / NEMO_RL_STEP / "policy")


if __name__ == "__main__":
    main(sys.argv[1:])
