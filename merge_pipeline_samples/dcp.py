"""Real torch.distributed.checkpoint (DCP) folders, written by FSDP2 on CPU (gloo), as trainers save them.

A tiny HF Llama with seeded random weights (vocabulary 1003: its embedding and head split unevenly
over two ranks) is saved as the reference; the FSDP sample writer's launcher forks one process per
rank, each ``fully_shard``s a module tree and saves it with ``dcp.save`` the way one trainer does:

- ``accelerate``: accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` (FSDP plugin,
  SHARDED_STATE_DICT) into ``<checkpoint>/pytorch_model_fsdp_0/`` and ``optimizer_0/``.
- ``nemo_rl`` / ``nemo_automodel``: what their DCP savers hand to ``dcp.save`` (NeMo-RL wraps the
  model's state dict under "model", NeMo-Automodel saves it flat), into ``weights/`` or ``model/``.
  Reproduced from their source (NeMo-RL at 7ea279a); NeMo-Automodel 0.7.0 itself writes its own
  fixtures in its own venv: ``nemo_automodel_save.py``.
- ``nemo_automodel_safetensors``: NeMo-Automodel's sharded safetensors save (``model_save_format:
  safetensors`` without consolidation): ``dcp.save`` through torch's own ``HuggingFaceStorageWriter``
  (NeMo-Automodel 0.7 hands its backport of that writer its ``fqn_to_file_index_mapping``, from the
  original model's index: two files here) with ``save_distributed=True``: ``model/shard-<rank>-model-<k>-of-2.safetensors``.
- ``torchtitan``: torchtitan's older Llama names (before 0.3: ``attention.wq``, ``output``), reproduced
  from its source: the module tree carries them with q/k rows in torchtitan's rotary
  layout (its adapter's ``from_hf``), and the rank saves what torchtitan's CheckpointManager saves:
  the model's state dict flattened to the top level beside ``optimizer`` (flattened AdamW state),
  ``lr_scheduler`` and ``train_state``, into ``step-N/``. torchtitan 0.3 itself writes its own
  checkpoints in its own venv: ``torchtitan_save.py``.

Neither writes a config or tokenizer into the checkpoint; the reference folder is the original HF
model folder (weights, config, tokenizer) a user passes as ``--hf_model_path``.

    python -m merge_pipeline_samples.dcp OUT_DIR --source torchtitan|accelerate --reference-dir REF
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from .fsdp import (
    FsdpSpec,
    _causal_lm_config,
    _fork_ranks,
    _launch_ranks,
    _rebuild_module,
    _shard,
    _wait,
    _write_reference,
)

_MODULE = "merge_pipeline_samples.dcp"
# The folder each writes the model's DCP into, inside the folder it is given.
MODEL_DIRS = {
    "torchtitan": ".",
    "accelerate": "pytorch_model_fsdp_0",
    "nemo_rl": "weights",
    "nemo_automodel": "model",
    "nemo_automodel_safetensors": "model",
}
SOURCES = tuple(MODEL_DIRS)
TORCHTITAN_STEP = 10

# torchtitan's Llama names (torchtitan/models/llama3/model/model.py) for each HF name. Written out here,
# not taken from the reader's table: a sample built from the reader's own table could not catch a wrong entry.
_TORCHTITAN_LAYER = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TORCHTITAN_TOP = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}


@dataclass(frozen=True, kw_only=True)
class DcpSpec:
    """Which trainer's folder to write. Hashable, so test fixtures can cache by spec."""

    source: str  # one of SOURCES
    world_size: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, not {self.source!r}")

    @property
    def model(self) -> FsdpSpec:
        # vocab_size 1003 (FsdpSpec's default) is odd: the embedding and lm_head shard unevenly.
        return FsdpSpec(arch="llama", world_size=self.world_size, seed=self.seed)


def write_dcp_checkpoint(out_dir: Path, spec: DcpSpec, *, reference_dir: Path, timeout: float = 300) -> Path:
    """Write the trainer's checkpoint folder ``out_dir`` and the original HF model in ``reference_dir``
    (``model.safetensors``, ``config.json``, tokenizer). Returns the folder holding ``.metadata``."""
    from .tokenizer import write_tokenizer

    out_dir, reference_dir = Path(out_dir), Path(reference_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = _causal_lm_config(spec.model)
    job = _write_reference(spec.model, config, reference_dir)
    write_tokenizer(reference_dir, vocab_size=spec.model.vocab_size)
    with tempfile.TemporaryDirectory(prefix="dcp-sample-") as scratch:
        scratch = Path(scratch)
        if spec.source == "torchtitan":
            job = _torchtitan_weights(job, config, scratch / "torchtitan.safetensors")
        job.update(source=spec.source, out_dir=str(out_dir), world_size=spec.world_size)
        job_path = scratch / "job.json"
        job_path.write_text(json.dumps(job))
        with _launch_ranks(job_path, _MODULE) as launcher:
            _wait(launcher, scratch, spec.world_size, timeout)
    return out_dir / MODEL_DIRS[spec.source]


def torchtitan_name(hf_name: str) -> str:
    module, _, leaf = hf_name.rpartition(".")
    if module in _TORCHTITAN_TOP:
        return f"{_TORCHTITAN_TOP[module]}.{leaf}"
    _, _, layer, inner = module.split(".", 3)  # model.layers.<i>.<inner>
    return f"layers.{layer}.{_TORCHTITAN_LAYER[inner]}.{leaf}"


def _torchtitan_weights(job: dict, config, path: Path) -> dict:
    """The reference under torchtitan's names, q/k rows as torchtitan keeps them (its ``from_hf``)."""
    weights = load_file(job["weights"])
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    renamed = {}
    for name in job["names"]:
        tensor = weights[name]
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            groups = heads if name.endswith("q_proj.weight") else kv_heads
            rows, columns = tensor.shape
            tensor = tensor.view(groups, 2, rows // groups // 2, columns).transpose(1, 2).reshape(rows, columns)
        renamed[torchtitan_name(name)] = tensor.contiguous()
    save_file(renamed, path)
    return {"weights": str(path), "names": list(renamed), "aliases": {}, "frozen": []}


# --- rank processes -------------------------------------------------------------------------------


def _run_rank(job: dict, rank: int) -> None:
    world_size = job["world_size"]
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        module = _rebuild_module(job, load_file(job["weights"]))
        if job["source"] == "torchtitan":  # its Llama keeps the rotary table as a persistent buffer
            module.register_buffer("freqs_cis", torch.polar(torch.ones(64, 8), torch.arange(512.0).view(64, 8)))
        model = _shard(module, mesh, fsdp_version=2)
        optimizer = _trained_optimizer(model)
        save = {
            "torchtitan": _save_torchtitan,
            "accelerate": _save_accelerate,
            "nemo_rl": _save_nemo_rl,
            "nemo_automodel": _save_nemo_automodel,
            "nemo_automodel_safetensors": _save_nemo_automodel_safetensors,
        }[job["source"]]
        save(model, optimizer, Path(job["out_dir"]))
    finally:
        dist.destroy_process_group()


def _trained_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW after one step at lr=0: real moments to skip, weights bit for bit unchanged."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return optimizer


def _save_torchtitan(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step_dir: Path) -> None:
    """As torchtitan's CheckpointManager.save: model keys at the top level (``_flattened_model_states_sd``),
    the other states under their names; its OptimizersContainer flattens the optimizer state dict."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state["lr_scheduler"] = scheduler.state_dict()
    state["train_state"] = {"step": TORCHTITAN_STEP, "ntokens_seen": 4096 * TORCHTITAN_STEP}
    dcp.save(state, checkpoint_id=step_dir)


def _save_accelerate(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: Path) -> None:
    """accelerate's own FSDP2 SHARDED_STATE_DICT save (what ``Accelerator.save_state`` calls)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True)
    save_fsdp_model(plugin, accelerator, model, str(out_dir))
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(out_dir))


def _save_nemo_rl(model: torch.nn.Module, optimizer: torch.optim.Optimizer, policy_dir: Path) -> None:
    """As NeMo-RL's native_checkpoint.save_checkpoint: ``{"model": ModelState(model)}`` into
    ``policy/weights``, ``{"optim": OptimizerState(...)}`` into ``policy/optimizer``."""
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=policy_dir / "weights")
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=policy_dir / "optimizer")


def _save_nemo_automodel(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: Path) -> None:
    """As NeMo-Automodel's Checkpointer with model_save_format "torch_save": ModelState's flat HF state
    dict into ``model/``, the optimizer into ``optim/``."""
    dcp.save(get_model_state_dict(model), checkpoint_id=out_dir / "model")
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=out_dir / "optim")


def _save_nemo_automodel_safetensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: Path) -> None:
    """As NeMo-Automodel's Checkpointer with model_save_format "safetensors", not consolidated: each
    rank's DTensor shards through ``HuggingFaceStorageWriter``, the tensors spread over two files."""
    state = get_model_state_dict(model)
    mapping = {name: 1 + 2 * i // len(state) for i, name in enumerate(state)}
    writer = HuggingFaceStorageWriter(str(out_dir / "model"), fqn_to_index_mapping=mapping, save_distributed=True)
    dcp.save(state, storage_writer=writer)
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=out_dir / "optim")


# --- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ranks"]:  # internal: the rank launcher started by write_dcp_checkpoint
        sys.exit(_fork_ranks(Path(argv[1]), _run_rank))
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="checkpoint folder to write (torchtitan: its step-N/)")
    parser.add_argument("--source", choices=SOURCES, required=True)
    parser.add_argument("--reference-dir", type=Path, required=True, help="the original HF model folder to write")
    parser.add_argument("--world-size", type=int, default=DcpSpec(source="torchtitan").world_size)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    spec = DcpSpec(source=args.source, world_size=args.world_size, seed=args.seed)
    print(write_dcp_checkpoint(args.out_dir, spec, reference_dir=args.reference_dir))


if __name__ == "__main__":
    main()
