"""Real verl-style FSDP checkpoints, written by torch FSDP on CPU (gloo), one OS process per rank.

The calling process builds the transformers model from a config with seeded random weights and
saves them as the reference. A launcher process (``--ranks``) imports torch once and forks one
process per rank; each rebuilds a module tree with the reference's parameter names, shards it with
FSDP1 or FSDP2 and ``torch.save``s its ``state_dict()`` the way verl does. transformers, peft and
tokenizers are imported inside the calling-process functions only: the launcher never needs them.

    python -m merge_pipeline_samples.fsdp OUT_ROLE_DIR [--world-size N ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

_MODULE = "merge_pipeline_samples.fsdp"
_LAUNCHER_LOG = "launcher.log"
_REPO_ROOT = Path(__file__).resolve().parents[1]
_CONFIGS = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM")}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
_LAYOUTS = ("rl", "sft")


@dataclass(frozen=True, kw_only=True)
class FsdpSpec:
    """What to train and how to shard it. Hashable, so test fixtures can cache by spec."""

    arch: str = "qwen2"  # "qwen2" | "llama"
    world_size: int = 2
    fsdp_version: int = 2  # 1 = FullyShardedDataParallel (SHARDED_STATE_DICT), 2 = fully_shard
    mesh: tuple[int, ...] | None = None  # None: 1-D ("fsdp",); (R, F): 2-D HSDP ("ddp", "fsdp")
    dim_names: tuple[str, ...] | None = None  # mesh dim names, e.g. VeOmni's ("dp_shard",); None: verl's
    # Instead of FSDP, place every tensor with these DTensor placements on the 2-D mesh, as an engine
    # combining FSDP with tensor parallelism does: "S<d>" = Shard(d) ("R" or a d the tensor lacks = Replicate).
    placements: tuple[str, ...] | None = None
    dtype: torch.dtype = torch.float32  # dtype of the stored weights
    hidden_size: int = 64
    num_layers: int = 2
    vocab_size: int = 1003
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = False
    critic: bool = False  # value model: token classification with one label
    lora: tuple[int, int] | None = None  # (r, lora_alpha) on q/k/v/o projections
    lora_only: bool = False  # verl's checkpoint.save_lora_only: rank files hold only the lora_* tensors
    layout: str = "rl"  # "sft": the SFT trainer's step folder, with data_<rank>.pt beside the model files
    with_tokenizer: bool = True
    with_generation_config: bool = True
    with_optimizer: bool = True  # optim_* and extra_state_* files beside the model files
    legacy_no_fsdp_config: bool = False  # older verl wrote no fsdp_config.json
    seed: int = 0
    # The seed's weights moved this far along one fixed direction: a later step of the same run, so the
    # step report shows small changes from the step before (another seed is a different model).
    trained_steps: int = 0

    def __post_init__(self):
        if self.arch not in _CONFIGS:
            raise ValueError(f"arch must be one of {sorted(_CONFIGS)}, not {self.arch!r}")
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"fsdp_version must be 1 or 2, not {self.fsdp_version}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be positive, not {self.world_size}")
        if self.mesh is not None and (len(self.mesh) != 2 or self.mesh[0] * self.mesh[1] != self.world_size):
            raise ValueError(f"mesh must be (replicas, shards) with a product of {self.world_size}: {self.mesh}")
        if self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {self.dtype}")
        if self.critic and self.lora:
            raise ValueError("LoRA on a critic is not supported")
        if self.lora_only and not self.lora:
            raise ValueError("lora_only needs lora")
        if self.layout not in _LAYOUTS:
            raise ValueError(f"layout must be one of {_LAYOUTS}, not {self.layout!r}")
        if self.dim_names is not None and len(self.dim_names) != len(self.mesh_shape):
            raise ValueError(f"dim_names {self.dim_names} do not name the {len(self.mesh_shape)} mesh dims")
        if self.placements is not None and (self.mesh is None or len(self.placements) != 2 or self.fsdp_version != 2):
            raise ValueError("placements need a 2-D mesh, one placement per mesh dim, and fsdp_version 2")

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.world_size,) if self.mesh is None else tuple(self.mesh)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        if self.dim_names is not None:
            return self.dim_names
        return ("fsdp",) if self.mesh is None else ("ddp", "fsdp")


def write_fsdp_checkpoint(
    role_dir: Path, spec: FsdpSpec, *, reference_dir: Path | None = None, timeout: float = 300
) -> None:
    """Write one verl FSDP role folder (e.g. ``global_step_3/actor``, or the SFT trainer's
    ``global_step_3``) into ``role_dir``.

    With ``reference_dir``, also keep the unsharded weights the ranks were sharded from
    (``model.safetensors``, tied tensors stored under each name) and the trained model's
    ``config.json``; for LoRA runs also ``base/``, the HF model folder training started from
    (verl's ``model.path``), as transformers saves it. Raises RuntimeError with the failing rank's output if a rank fails, and
    TimeoutError if the ranks take longer than ``timeout`` seconds; all ranks are killed then.
    """
    role_dir = Path(role_dir)
    role_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fsdp-sample-") as scratch:
        scratch = Path(scratch)
        config = _causal_lm_config(spec)
        job = _write_reference(spec, config, Path(reference_dir) if reference_dir is not None else scratch)
        job.update(
            role_dir=str(role_dir),
            fsdp_version=spec.fsdp_version,
            mesh_shape=spec.mesh_shape,
            mesh_dim_names=spec.mesh_dim_names,
            world_size=spec.world_size,
            with_optimizer=spec.with_optimizer,
            placements=spec.placements,
            lora_only=spec.lora_only,
            sft=spec.layout == "sft",
        )
        job_path = scratch / "job.json"
        job_path.write_text(json.dumps(job))
        with _launch_ranks(job_path) as launcher:
            _write_metadata(role_dir, spec, config)  # while the ranks start up
            _wait(launcher, scratch, spec.world_size, timeout)


def write_nemo_automodel_checkpoint(
    role_dir: Path, spec: FsdpSpec, *, reference_dir: Path | None = None, max_shard_size: str = "5GB"
) -> None:
    """The NeMo-Automodel engine's role folder: consolidated HF safetensors written by transformers,
    with config, generation config and tokenizer, in ``<role_dir>/model/``. No ranks are started."""
    from transformers import GenerationConfig

    from .tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, write_tokenizer

    config = _causal_lm_config(spec)
    model, _ = _build_model(spec, config)
    model_dir = Path(role_dir) / "model"
    model.save_pretrained(model_dir, max_shard_size=max_shard_size)
    GenerationConfig(eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID).save_pretrained(model_dir)
    write_tokenizer(model_dir, vocab_size=spec.vocab_size)
    if reference_dir is not None:
        _write_reference(spec, config, Path(reference_dir))


# --- calling process: model, reference, metadata ------------------------------------------------


def _causal_lm_config(spec: FsdpSpec):
    """The base model's config; verl saves it as ``huggingface/config.json`` for actors and critics."""
    import transformers

    from .tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID

    config_class, architecture = _CONFIGS[spec.arch]
    return getattr(transformers, config_class)(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        vocab_size=spec.vocab_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=4096,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        architectures=[architecture],
        dtype=spec.dtype,
    )


def _build_model(spec: FsdpSpec, config):
    """The module verl would train, with seeded random weights in ``spec.dtype``, and its config."""
    import peft
    import transformers

    if spec.critic:
        config = copy.deepcopy(config)
        config.num_labels = 1
        model = transformers.AutoModelForTokenClassification.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    trained_config = model.config
    trained_config.architectures = [type(model).__name__]
    trained_config.dtype = spec.dtype
    if spec.lora:
        r, alpha = spec.lora
        lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=_LORA_TARGETS, task_type="CAUSAL_LM")
        with warnings.catch_warnings():  # peft calls a transformers method deprecated in 5.x
            warnings.simplefilter("ignore", FutureWarning)
            model = peft.get_peft_model(model, lora)
    _randomize(model, spec.seed, spec.trained_steps)
    return model.to(spec.dtype), trained_config


def _write_base_model(model, spec: FsdpSpec, out_dir: Path) -> None:
    """The LoRA run's base model (frozen during training) as an HF folder: weights, config, tokenizer."""
    from .tokenizer import write_tokenizer

    base = copy.deepcopy(model).unload()  # the base weights without the LoRA layers, not merged
    base.save_pretrained(out_dir)
    if spec.with_tokenizer:
        write_tokenizer(out_dir, vocab_size=spec.vocab_size)


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int, trained_steps: int = 0) -> None:
    """Seeded weights with no structure a merge bug could hide behind: no ones, no zeros; moved
    ``trained_steps`` times by 1/50 of their scale along a direction seeded by ``seed`` too."""
    generator = torch.Generator().manual_seed(seed)
    direction = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        is_norm = "norm" in name.rsplit(".", 2)[-2]
        scale = 0.1 if is_norm else 0.05
        param.copy_((1.0 if is_norm else 0.0) + scale * noise)
        if trained_steps:
            param.add_(torch.randn(param.shape, generator=direction), alpha=scale * trained_steps / 50)


def _write_reference(spec: FsdpSpec, config, out_dir: Path) -> dict:
    """Save the unsharded weights and config to ``out_dir``; return what a rank needs to rebuild them."""
    model, trained_config = _build_model(spec, config)
    state = model.state_dict(keep_vars=True)
    first_name: dict[int, str] = {}
    aliases = {}  # tied parameters: later name -> first name of the same Parameter
    for name, param in state.items():
        first = first_name.setdefault(id(param), name)
        if first != name:
            aliases[name] = first
    out_dir.mkdir(parents=True, exist_ok=True)
    # safetensors refuses shared storage, so a tied tensor is stored under each of its names.
    tensors = {name: param.detach().clone() if name in aliases else param.detach() for name, param in state.items()}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    trained_config.save_pretrained(out_dir)
    if spec.lora:
        _write_base_model(model, spec, out_dir / "base")
    return {
        "weights": str(out_dir / "model.safetensors"),
        "names": list(state),
        "aliases": aliases,
        "frozen": [name for name, param in state.items() if not param.requires_grad],
    }


def _write_metadata(role_dir: Path, spec: FsdpSpec, config) -> None:
    """Everything verl writes beside the weight shards."""
    from transformers import GenerationConfig

    from .tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID, write_tokenizer

    if not spec.legacy_no_fsdp_config:
        fsdp_config = {"FSDP_version": spec.fsdp_version, "world_size": spec.world_size}
        (role_dir / "fsdp_config.json").write_text(json.dumps(fsdp_config, indent=4))
    if spec.lora:
        r, alpha = spec.lora
        lora_meta = {"r": r, "lora_alpha": alpha, "task_type": "CAUSAL_LM"}
        (role_dir / "lora_train_meta.json").write_text(json.dumps(lora_meta, indent=4))
    hf_dir = role_dir / "huggingface"
    config.save_pretrained(hf_dir)
    if spec.with_generation_config:
        generation = GenerationConfig(
            eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID, do_sample=True, temperature=0.7, top_p=0.8
        )
        generation.save_pretrained(hf_dir)
    if spec.with_tokenizer:
        write_tokenizer(hf_dir, vocab_size=spec.vocab_size)


# --- calling process: the rank launcher ---------------------------------------------------------


@contextlib.contextmanager
def _launch_ranks(job_path: Path, module: str = _MODULE):
    """Start the rank launcher (``module``'s ``_fork_ranks``) in a new process group; kill the group on leaving."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",  # ranks share few cores; more threads only contend
        "PYTHONWARNINGS": "ignore",  # FSDP1 deprecation, world-size-1 and DTensor notices
        "TORCH_CPP_LOG_LEVEL": "ERROR",  # gloo and c10d chatter
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", module, "--ranks", str(job_path)]
    with open(job_path.parent / _LAUNCHER_LOG, "wb") as log:
        launcher = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield launcher
    finally:
        # A launcher that finished cleanly has reaped every rank. Otherwise kill its whole group,
        # which also ends ranks a dead launcher left behind (none left: ProcessLookupError).
        if launcher.poll() != 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def _wait(launcher: subprocess.Popen, log_dir: Path, world_size: int, timeout: float) -> None:
    try:
        code = launcher.wait(timeout)
    except subprocess.TimeoutExpired:
        reports = "\n".join(_rank_report(log_dir, rank, world_size, "at the timeout") for rank in range(world_size))
        raise TimeoutError(f"FSDP ranks still running after {timeout} s\n{reports}") from None
    if code != 0:  # the launcher printed the failing rank's report, or its own traceback
        raise RuntimeError((log_dir / _LAUNCHER_LOG).read_text(errors="replace")[-8000:])


def _rank_log(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank_{rank}.log"


def _rank_report(log_dir: Path, rank: int, world_size: int, status: str) -> str:
    log = _rank_log(log_dir, rank)
    output = log.read_text(errors="replace")[-4000:] if log.is_file() else ""
    return f"FSDP rank {rank} of {world_size} ({status}), output:\n{output}"


# --- rank launcher and rank processes -------------------------------------------------------------


def _fork_ranks(job_path: Path, run_rank: Callable[[dict, int], None] | None = None) -> int:
    """Fork one process per rank and wait for them; once one fails, kill the rest.

    Forked ranks inherit this process's imports instead of paying seconds of torch start-up each.
    The fork is safe: only one thread runs here, and nothing has touched OpenMP or a process group.
    Returns the exit code; the output of every rank that failed by itself is printed. ``run_rank``
    (default: this module's ``_run_rank``) is what each rank does: other sample writers pass theirs.
    """
    import torch._dynamo  # noqa: F401  (DTensor imports it on first use; once here, not per rank)

    job = json.loads(job_path.read_text())
    world_size = job["world_size"]
    sys.stdout.flush()  # or a child would write this process's buffered output again
    sys.stderr.flush()
    children = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _rank_process(job, rank, _rank_log(job_path.parent, rank), run_rank or _run_rank)
        children[pid] = rank
    failed = {}
    while children and not failed:
        pid, status = os.wait()
        rank, code = children.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0:
            failed[rank] = code
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid, rank in children.items():
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code not in (0, -signal.SIGKILL):  # a peer may have died of the same cause meanwhile
            failed[rank] = code
    for rank, code in sorted(failed.items()):
        print(_rank_report(job_path.parent, rank, world_size, f"exit code {code}"))
    return 1 if failed else 0


def _rank_process(job: dict, rank: int, log_path: Path, run_rank: Callable[[dict, int], None]) -> NoReturn:
    """The body of a forked rank. It ends the process: it must never return into the launcher loop."""
    code = 1
    try:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        run_rank(job, rank)
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Container(torch.nn.Module):
    """Holds parameters under the checkpoint's names. Never called: saving needs no forward."""


class _DecoderLayer(_Container):
    """A ``...layers.<i>`` module: its own FSDP unit, as verl's wrap policy makes each decoder layer."""


def _run_rank(job: dict, rank: int) -> None:
    world_size = job["world_size"]
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", tuple(job["mesh_shape"]), mesh_dim_names=tuple(job["mesh_dim_names"]))
        role_dir = Path(job["role_dir"])
        suffix = f"world_size_{world_size}_rank_{rank}.pt"
        if job["placements"]:
            state = _placed_state_dict(job, load_file(job["weights"]), mesh)
        else:
            model = _shard(_rebuild_module(job, load_file(job["weights"])), mesh, job["fsdp_version"])
            if job["with_optimizer"]:
                _save_optimizer_state(model, role_dir, suffix)
            state = _model_state_dict(model, job["fsdp_version"])
        if job["lora_only"]:  # what verl keeps with checkpoint.save_lora_only=True
            state = type(state)((name, value) for name, value in state.items() if "lora_" in name)
        torch.save(state, role_dir / f"model_{suffix}")
        if job["sft"]:  # the SFT trainer's dataloader state, one file per data-parallel rank
            torch.save({"epoch": 0, "samples_yielded": 8 * rank}, role_dir / f"data_{rank}.pt")
    finally:
        dist.destroy_process_group()


def _rebuild_module(job: dict, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module tree whose ``state_dict()`` has exactly the reference's names, order and ties."""
    frozen = set(job["frozen"])
    modules: dict[str, torch.nn.Module] = {"": _Container()}

    def module_at(path: str) -> torch.nn.Module:
        if path not in modules:
            parent, _, child = path.rpartition(".")
            is_layer = parent.rpartition(".")[2] == "layers" and child.isdigit()
            modules[path] = _DecoderLayer() if is_layer else _Container()
            module_at(parent).add_module(child, modules[path])
        return modules[path]

    for name in job["names"]:
        path, _, leaf = name.rpartition(".")
        if name in job["aliases"]:
            param = modules[""].get_parameter(job["aliases"][name])
        else:
            param = torch.nn.Parameter(weights[name], requires_grad=name not in frozen)
        module_at(path).register_parameter(leaf, param)
    return modules[""]


def _placed_state_dict(job: dict, weights: dict[str, torch.Tensor], mesh) -> dict[str, torch.Tensor]:
    """Every tensor as a DTensor with the requested placements (Replicate where it lacks the dim)."""

    def placement(code: str, tensor: torch.Tensor):
        return Shard(int(code[1:])) if code.startswith("S") and int(code[1:]) < tensor.dim() else Replicate()

    state = {}
    for name in job["names"]:
        tensor = weights[name]
        state[name] = distribute_tensor(tensor, mesh, [placement(code, tensor) for code in job["placements"]])
    return state


def _shard(module: torch.nn.Module, mesh, fsdp_version: int) -> torch.nn.Module:
    if fsdp_version == 2:
        for layer in [m for m in module.modules() if isinstance(m, _DecoderLayer)]:
            fully_shard(layer, mesh=mesh)
        return fully_shard(module, mesh=mesh)
    return FullyShardedDataParallel(
        module,
        auto_wrap_policy=ModuleWrapPolicy({_DecoderLayer}),
        sharding_strategy=ShardingStrategy.HYBRID_SHARD if mesh.ndim == 2 else ShardingStrategy.FULL_SHARD,
        device_mesh=mesh,  # with a mesh the sharded state dict holds DTensors, not ShardedTensors
        device_id=torch.device("cpu"),  # both needed on CPU
        sync_module_states=False,
        use_orig_params=True,  # clean parameter names; frozen and trainable (LoRA) params may mix
    )


def _model_state_dict(model: torch.nn.Module, fsdp_version: int) -> dict:
    if fsdp_version == 2:
        return model.state_dict()
    with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return model.state_dict()


def _save_optimizer_state(model: torch.nn.Module, role_dir: Path, suffix: str) -> None:
    """A real AdamW state and verl's extra state (lr scheduler, RNG states incl. numpy's).

    One step with zero gradients at lr=0 fills the moments and leaves the weights bit for bit alone.
    """
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    scheduler.step()
    torch.save(optimizer.state_dict(), role_dir / f"optim_{suffix}")
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    torch.save({"lr_scheduler": scheduler.state_dict(), "rng": rng}, role_dir / f"extra_state_{suffix}")


# --- command line -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    defaults = FsdpSpec()
    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}", description="Write a real verl-style FSDP checkpoint (CPU, gloo)."
    )
    parser.add_argument("role_dir", type=Path, help="role folder to write, e.g. ckpt/global_step_1/actor")
    parser.add_argument("--world-size", type=int, help=f"default: R*F with --mesh, else {defaults.world_size}")
    parser.add_argument("--fsdp-version", type=int, choices=(1, 2), default=defaults.fsdp_version)
    parser.add_argument("--arch", choices=sorted(_CONFIGS), default=defaults.arch)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--num-attention-heads", type=int, default=defaults.num_attention_heads)
    parser.add_argument("--num-key-value-heads", type=int, default=defaults.num_key_value_heads)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--critic", action="store_true")
    parser.add_argument("--lora", type=int, nargs=2, metavar=("R", "ALPHA"))
    parser.add_argument("--mesh", type=int, nargs=2, metavar=("R", "F"), help="2-D HSDP mesh (replicas, shards)")
    parser.add_argument(
        "--mesh-dim-name",
        dest="mesh_dim_names",
        action="append",
        help="name of each mesh dim, in order (e.g. dp_shard)",
    )
    parser.add_argument(
        "--placements",
        nargs=2,
        metavar=("P0", "P1"),
        help="DTensor placements on the 2-D mesh instead of FSDP: S<d> or R",
    )
    parser.add_argument(
        "--lora-only", action="store_true", help="keep only the lora_* tensors (checkpoint.save_lora_only)"
    )
    parser.add_argument(
        "--layout",
        choices=_LAYOUTS,
        default=defaults.layout,
        help="sft: the SFT trainer's step folder (pass global_step_N as the folder)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--trained-steps",
        type=int,
        default=defaults.trained_steps,
        help="the seed's weights after this many steps along one direction: a later step of the same run",
    )
    parser.add_argument("--reference-dir", type=Path, help="also write the unsharded weights and config here")
    parser.add_argument("--timeout", type=float, default=300)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ranks"]:  # internal: the rank launcher started by write_fsdp_checkpoint
        sys.exit(_fork_ranks(Path(argv[1])))
    parser = _parser()
    args = parser.parse_args(argv)
    world_size = args.world_size or (args.mesh[0] * args.mesh[1] if args.mesh else FsdpSpec().world_size)
    try:
        spec = _spec_from_args(args, world_size)
    except ValueError as error:
        parser.error(str(error))
    write_fsdp_checkpoint(args.role_dir, spec, reference_dir=args.reference_dir, timeout=args.timeout)


def _spec_from_args(args: argparse.Namespace, world_size: int) -> FsdpSpec:
    return FsdpSpec(
        arch=args.arch,
        world_size=world_size,
        fsdp_version=args.fsdp_version,
        mesh=tuple(args.mesh) if args.mesh else None,
        dtype=_DTYPES[args.dtype],
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        vocab_size=args.vocab_size,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        tie_word_embeddings=args.tie_word_embeddings,
        critic=args.critic,
        lora=tuple(args.lora) if args.lora else None,
        lora_only=args.lora_only,
        dim_names=tuple(args.mesh_dim_names) if args.mesh_dim_names else None,
        placements=tuple(args.placements) if args.placements else None,
        layout=args.layout,
        seed=args.seed,
        trained_steps=args.trained_steps,
    )


if __name__ == "__main__":
    main()
