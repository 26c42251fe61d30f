"""Real DeepSpeed ZeRO 1/2/3 checkpoints, trained and saved by DeepSpeed itself on CPU (gloo).

The calling process writes the model config (and, for the HF Trainer layout, the tokenizer) and
starts one ``torchrun`` with one process per data-parallel rank. Each rank builds the same seeded
tiny Llama from that config, runs ``deepspeed.initialize`` and two AdamW steps, then
``engine.save_checkpoint(save_dir)``: ``<save_dir>/latest`` and ``<save_dir>/global_step2/``, as
OpenRLHF and the HF Trainer save them. Rank 0 also saves the trained weights, gathered by DeepSpeed
(``GatheredParameters`` under ZeRO-3), as ``trained.safetensors``. Several checkpoints are written
by one launch: importing deepspeed and transformers costs more than training the tiny model.

    python -m merge_pipeline_samples.deepspeed OUT_SAVE_DIR --stage 3 [--tie-word-embeddings]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_MODULE = "merge_pipeline_samples.deepspeed"
_REPO_ROOT = Path(__file__).resolve().parents[1]
TRAINED_WEIGHTS = "trained.safetensors"  # beside the checkpoint folders, in the reference folder
TRAIN_STEPS = 2


@dataclass(frozen=True, kw_only=True)
class DeepSpeedSpec:
    """What to train and how. Hashable, so test fixtures can cache by spec."""

    stage: int = 2  # ZeRO stage 1, 2 or 3
    world_size: int = 2
    # Odd sizes on purpose: norms, embeddings and lm_head have odd element counts, so ZeRO pads.
    hidden_size: int = 45
    head_dim: int = 8
    num_attention_heads: int = 5
    num_key_value_heads: int = 1
    intermediate_size: int = 96
    num_layers: int = 2
    vocab_size: int = 1003
    tie_word_embeddings: bool = False
    frozen: tuple[str, ...] = ()  # parameter names trained with requires_grad=False
    bf16: bool = False  # DeepSpeed's bf16 mode (OpenRLHF's default): bf16 module, fp32 master weights
    openrlhf_actor: bool = False  # train the model inside OpenRLHF's Actor wrapper (``self.model``)
    hf_files: bool = True  # config.json + tokenizer beside `latest` (HF Trainer); False: OpenRLHF's ckpt folder
    seed: int = 0

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3, not {self.stage}")


def write_deepspeed_checkpoints(jobs: list[tuple[Path, Path, DeepSpeedSpec]], *, timeout: float = 600) -> None:
    """For each ``(save_dir, reference_dir, spec)``: train with DeepSpeed and save into ``save_dir``;
    ``reference_dir`` gets ``config.json`` and the trained weights (``TRAINED_WEIGHTS``).

    All jobs must share one world size: they run in one torchrun. Raises RuntimeError with the ranks'
    output if a rank fails, TimeoutError after ``timeout`` seconds (all ranks are killed then).
    """
    world_sizes = {spec.world_size for _, _, spec in jobs}
    if len(world_sizes) != 1:
        raise ValueError(f"one torchrun writes all jobs: they need one world size, not {sorted(world_sizes)}")
    for save_dir, reference_dir, spec in jobs:
        _write_config_files(Path(save_dir), Path(reference_dir), spec)
    with tempfile.TemporaryDirectory(prefix="deepspeed-sample-") as scratch:
        job_path = Path(scratch) / "jobs.json"
        job_path.write_text(json.dumps([[str(s), str(r), asdict(spec)] for s, r, spec in jobs]))
        _torchrun(world_sizes.pop(), job_path, timeout)


def _write_config_files(save_dir: Path, reference_dir: Path, spec: DeepSpeedSpec) -> None:
    from .tokenizer import write_tokenizer

    config = _llama_config(spec)
    config.save_pretrained(reference_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    if spec.hf_files:  # the HF Trainer saves config and tokenizer in checkpoint-N/, beside `latest`
        config.save_pretrained(save_dir)
        write_tokenizer(save_dir, vocab_size=spec.vocab_size)


def _llama_config(spec: DeepSpeedSpec):
    import transformers

    from .tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID

    return transformers.LlamaConfig(
        hidden_size=spec.hidden_size,
        head_dim=spec.head_dim,
        num_hidden_layers=spec.num_layers,
        vocab_size=spec.vocab_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=256,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def _torchrun(world_size: int, job_path: Path, timeout: float) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        "-m",
        _MODULE,
        "--ranks",
        str(job_path),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # ranks share few cores; more threads only contend
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    log_path = job_path.parent / "torchrun.log"
    with open(log_path, "wb") as log:
        run = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = run.wait(timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"DeepSpeed ranks still running after {timeout} s:\n{_tail(log_path)}") from None
    finally:
        if run.poll() != 0:  # kill torchrun and every rank it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    if code != 0:
        raise RuntimeError(f"DeepSpeed ranks failed (exit code {code}):\n{_tail(log_path)}")


def _tail(log_path: Path) -> str:
    return log_path.read_text(errors="replace")[-8000:]


# --- rank processes (started by torchrun) ---------------------------------------------------------


def _run_ranks(job_path: Path) -> None:
    import deepspeed
    import torch.distributed as dist

    _skip_shm_all_reduce()
    deepspeed.init_distributed("gloo")
    try:
        for save_dir, reference_dir, spec in json.loads(job_path.read_text()):
            _train_and_save(
                Path(save_dir), Path(reference_dir), DeepSpeedSpec(**{**spec, "frozen": tuple(spec["frozen"])})
            )
    finally:
        dist.destroy_process_group()


def _skip_shm_all_reduce() -> None:
    """Keep ``init_distributed`` from compiling DeepSpeed's shared-memory all-reduce (a C++ op: minutes,
    and a compiler, on a fresh machine). It only speeds up inference all-reduces; training uses gloo's."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    # deepspeed.comm.torch.build_shm_op builds the op only if this table calls it compatible.
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def _train_and_save(save_dir: Path, reference_dir: Path, spec: DeepSpeedSpec) -> None:
    import deepspeed
    import torch.distributed as dist
    import transformers
    from safetensors.torch import save_file

    from .fsdp import _randomize

    config = transformers.AutoConfig.from_pretrained(reference_dir)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomize(model, spec.seed)
    for name in spec.frozen:
        model.get_parameter(name).requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    module = _Actor(model) if spec.openrlhf_actor else model
    engine, *_ = deepspeed.initialize(model=module, model_parameters=trainable, config=ds_config(spec))
    rank = dist.get_rank()
    for step in range(TRAIN_STEPS):  # each rank its own tokens: the gradients are really averaged
        tokens = torch.randint(0, spec.vocab_size, (1, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()
    engine.save_checkpoint(str(save_dir))
    # The trained weights, gathered by DeepSpeed; tied parameters are saved under each name.
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params) if spec.stage == 3 else contextlib.nullcontext():
        if rank == 0:
            state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
            save_file(state, reference_dir / TRAINED_WEIGHTS, metadata={"format": "pt"})
    dist.barrier()


def ds_config(spec: DeepSpeedSpec) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": spec.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "steps_per_print": 1000,
        "bf16": {"enabled": spec.bf16},
    }


class _Actor(torch.nn.Module):
    """OpenRLHF's ``Actor``: the HF model as ``self.model``, so DeepSpeed saves ``model.model.*`` names."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs)


# --- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--ranks"]:  # internal: a rank started by write_deepspeed_checkpoints' torchrun
        _run_ranks(Path(argv[1]))
        return
    defaults = DeepSpeedSpec()
    parser = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="Train a tiny model with DeepSpeed ZeRO on CPU and save its checkpoint.",
    )
    parser.add_argument("save_dir", type=Path, help="the folder engine.save_checkpoint writes (gets `latest`)")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=defaults.stage)
    parser.add_argument("--world-size", type=int, default=defaults.world_size)
    parser.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    parser.add_argument("--num-attention-heads", type=int, default=defaults.num_attention_heads)
    parser.add_argument("--num-key-value-heads", type=int, default=defaults.num_key_value_heads)
    parser.add_argument("--num-layers", type=int, default=defaults.num_layers)
    parser.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--tie-word-embeddings", action="store_true")
    parser.add_argument("--freeze", action="append", default=[], help="parameter name to train frozen")
    parser.add_argument("--bf16", action="store_true", help="DeepSpeed's bf16 mode (fp32 master weights)")
    parser.add_argument("--openrlhf-actor", action="store_true", help="wrap the model as OpenRLHF's Actor does")
    parser.add_argument("--no-hf-files", action="store_true", help="no config.json/tokenizer beside `latest`")
    parser.add_argument("--reference-dir", type=Path, help="default: SAVE_DIR/../reference")
    args = parser.parse_args(argv)
    spec = DeepSpeedSpec(
        stage=args.stage,
        world_size=args.world_size,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        num_layers=args.num_layers,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_word_embeddings,
        frozen=tuple(args.freeze),
        bf16=args.bf16,
        openrlhf_actor=args.openrlhf_actor,
        hf_files=not args.no_hf_files,
    )
    write_deepspeed_checkpoints([(args.save_dir, args.reference_dir or args.save_dir.parent / "reference", spec)])


if __name__ == "__main__":
    main()
