"""Benchmark checkpoints: real verl FSDP role folders of a few sizes, written once and cached.

The writer runs in a child process (``python -m benchmarks.checkpoints``) so that the benchmark
runner never imports torch or transformers: a child's ``ru_maxrss`` starts from its parent's peak
RSS (Linux keeps the pre-exec high-water mark), so a small runner keeps every measured peak honest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO_ROOT / "benchmarks" / ".cache"
CACHE_VERSION = 1  # bump when the writer's output changes in a way that matters to the benchmark

# Llama shapes, world size 4, fp32 weights, no optimizer files (the merge never reads them).
_COMMON = {"arch": "llama", "world_size": 4, "fsdp_version": 2, "dtype": "float32", "with_optimizer": False}
SIZES: dict[str, dict] = {
    # ~0.6M: only for smoke runs of the benchmark machinery
    "tiny": {
        "hidden_size": 64,
        "num_layers": 2,
        "vocab_size": 4000,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # ~24M
    "small": {
        "hidden_size": 256,
        "num_layers": 8,
        "vocab_size": 32000,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    # ~101M
    "medium": {
        "hidden_size": 768,
        "num_layers": 6,
        "vocab_size": 32000,
        "intermediate_size": 3072,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
    # ~248M: the configuration of the 248M figures (hidden 1024, 12 layers, vocab 32000)
    "large": {
        "hidden_size": 1024,
        "num_layers": 12,
        "vocab_size": 32000,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    # ~1.1B: TinyLlama's shapes at world size 2, the configuration of the lossless figures (4.4 GB of rank files)
    "1.1b": {
        "hidden_size": 2048,
        "num_layers": 22,
        "vocab_size": 32000,
        "intermediate_size": 5632,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "world_size": 2,
    },
    # Llama-3-8B (8.03B: 32 GB of fp32 rank files at world size 8, more than this machine's memory; with
    # two bf16 outputs beside them ~64 GB of disk). Too large to build whole: the rank files are drawn
    # rank by rank from a seeded generator (``write_generated_checkpoint``).
    "8b": {
        "hidden_size": 4096,
        "num_layers": 32,
        "vocab_size": 128256,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "world_size": 8,
        "writer": "generated",
    },
}


# Megatron-Core (megatron-core itself writes them, TP=2 on two CPU ranks): the presets of
# merge_pipeline_samples.megatron.SIZE_PRESETS.
MEGATRON_SIZES = {"tiny": "tiny", "large": "250m", "1.1b": "1b"}
# 64 ranks (megatron_fake_pg's variants): "large" is ~258M parameters in 16 layers at TP=8 x PP=8 (PP=8
# needs 8 | layers); "moe128" a small Mixtral of 16 layers x 128 experts at TP=2 x EP=8 x PP=4.
MEGATRON_AT_SCALE = {
    "tiny": "llama_tp8_pp8",
    "large": "llama_250m_tp8_pp8",
    "moe128": "mixtral_128_experts_tp2_ep8_pp4",
}


@dataclass(frozen=True)
class Checkpoint:
    name: str
    role_dir: Path  # .../global_step_1/actor
    spec: dict
    backend: str = "fsdp"
    merge_flags: tuple[str, ...] = ()  # what the merge needs beside the folder (a configless DCP's --hf_model_path)

    @property
    def model_files(self) -> list[Path]:
        """The files a merge reads tensor data from: FSDP rank files, Megatron's dist_ckpt/, a DCP folder's
        .distcp files or a DeepSpeed tag folder's states."""
        if self.backend == "megatron":
            return sorted(p for p in (self.role_dir / "dist_ckpt").iterdir() if p.is_file())
        if self.backend == "dcp":
            return sorted(self.role_dir.glob("*.distcp"))
        if self.backend == "deepspeed":
            return sorted(self.role_dir.glob("*/*_states.pt"))
        return sorted(self.role_dir.glob("model_world_size_*_rank_*.pt"))

    @property
    def input_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.model_files)


def spec_for(size: str) -> dict:
    if size not in SIZES:
        raise SystemExit(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    return {**_COMMON, **SIZES[size]}


def parameter_count(spec: dict) -> int:
    """Parameters of the Llama model a spec describes (untied embeddings, no biases)."""
    h, i, v, layers = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"], spec["num_layers"]
    kv = h // spec["num_attention_heads"] * spec["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 2 * v * h + layers * per_layer + h


def _cached(cache_dir: Path, name: str, spec: dict, write_args: list[str], description: str, log) -> Path:
    """``cache_dir/<name>-<hash of spec>``, written by ``benchmarks.checkpoints`` if missing.

    Written into a ``.partial`` folder and renamed, so a killed write leaves nothing cached.
    """
    key = hashlib.sha256(json.dumps({"v": CACHE_VERSION, **spec}, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cache_dir) / f"{name}-{key}"
    if not root.is_dir():
        staging = root.with_name(root.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        log(f"writing {description} to {root} ...")
        write_args = [a.replace("{staging}", str(staging)) for a in write_args]
        subprocess.run(
            [sys.executable, "-m", "benchmarks.checkpoints", *write_args, json.dumps(spec)], check=True, cwd=REPO_ROOT
        )
        staging.rename(root)
    return root


def ensure_checkpoint(size: str, cache_dir: Path = DEFAULT_CACHE, *, log=print) -> Checkpoint:
    """The cached FSDP checkpoint for ``size``, written first if missing."""
    spec = spec_for(size)
    description = (
        f"the {size} FSDP checkpoint (~{parameter_count(spec) / 1e6:.0f}M parameters, world size {spec['world_size']})"
    )
    root = _cached(cache_dir, f"fsdp-{size}", spec, ["{staging}/global_step_1/actor"], description, log)
    return Checkpoint(size, root / "global_step_1" / "actor", spec)


def ensure_world_size_checkpoint(
    size: str, world_size: int, cache_dir: Path = DEFAULT_CACHE, *, log=print
) -> Checkpoint:
    """The same weights as ``size``, saved at ``world_size`` ranks by torch's fake process group (one
    process plays every rank: ``merge_pipeline_samples.fsdp_fake_pg``), named ``size@wsN``."""
    spec = {"writer": "fake_pg", **spec_for(size), "world_size": world_size}
    name = f"{size}@ws{world_size}"
    description = f"the {size} FSDP checkpoint at world size {world_size} (fake process group)"
    root = _cached(cache_dir, f"fsdp-{size}-ws{world_size}", spec, ["{staging}/global_step_1/actor"], description, log)
    return Checkpoint(name, root / "global_step_1" / "actor", spec)


def ensure_format_world_size_checkpoint(
    backend: str, size: str, world_size: int, cache_dir: Path = DEFAULT_CACHE, *, log=print
) -> Checkpoint:
    """The ``size`` weights saved at ``world_size`` ranks in ``backend``'s format, each by its trainer's own
    save code in one process under torch's fake process group: FSDP2 rank files (``fsdp_fake_pg``),
    torchtitan's DCP (``dcp_fake_pg``: torch's DCP save steps rank by rank), DeepSpeed ZeRO-3
    (``deepspeed_fake_pg``: ``deepspeed.initialize`` + ``save_checkpoint`` rank by rank) or Megatron-Core
    at TP=8 x PP=8 (``megatron_fake_pg``: megatron-core's model and ``dist_checkpointing`` save steps)."""
    if backend == "fsdp":
        return ensure_world_size_checkpoint(size, world_size, cache_dir, log=log)
    if backend == "megatron":
        return _megatron_at_scale(size, world_size, cache_dir, log)
    if backend not in ("dcp", "deepspeed"):
        raise SystemExit(f"no {backend!r} world-size checkpoint; choose from fsdp, dcp, deepspeed, megatron")
    spec = {**spec_for(size), "world_size": world_size, "format": backend}
    description = f"the {size} weights as a {backend} checkpoint of {world_size} ranks (fake process group)"
    root = _cached(cache_dir, f"{backend}-{size}-ws{world_size}", spec, ["--format", "{staging}"], description, log)
    flags = ("--hf_model_path", str(root / "reference")) if backend == "dcp" else ()
    folder = root / ("step-1" if backend == "dcp" else "ckpt")
    return Checkpoint(f"{size}@ws{world_size}", folder, spec, backend=backend, merge_flags=flags)


def _megatron_at_scale(size: str, world_size: int, cache_dir: Path, log) -> Checkpoint:
    """Megatron-Core at 64 ranks, saved by megatron-core's own code rank by rank (``megatron_fake_pg``)."""
    if size not in MEGATRON_AT_SCALE or world_size != 64:
        raise SystemExit(f"Megatron at scale: world size 64 of sizes {', '.join(MEGATRON_AT_SCALE)}")
    spec = {"variant": MEGATRON_AT_SCALE[size], "world_size": world_size, "format": "megatron"}
    description = f"the {size} Megatron-Core checkpoint of 64 ranks (fake process group)"
    root = _cached(cache_dir, f"megatron-{size}-ws64", spec, ["--format", "{staging}"], description, log)
    return Checkpoint(f"{size}@ws64", root / spec["variant"] / "actor", spec, backend="megatron")


def _write_format(root: Path, spec: dict) -> None:
    from merge_pipeline_samples.dcp_fake_pg import write_fake_pg_dcp
    from merge_pipeline_samples.deepspeed import DeepSpeedSpec
    from merge_pipeline_samples.deepspeed_fake_pg import write_fake_pg_deepspeed
    from merge_pipeline_samples.fsdp import FsdpSpec

    if spec["format"] == "megatron":
        from merge_pipeline_samples.megatron_fake_pg import VARIANTS, write_fake_pg_megatron

        write_fake_pg_megatron(root, VARIANTS[spec["variant"]], spec["world_size"])
        return
    shapes = {k: spec[k] for k in ("hidden_size", "num_layers", "vocab_size", "intermediate_size")}
    shapes |= {k: spec[k] for k in ("num_attention_heads", "num_key_value_heads")}
    if spec["format"] == "dcp":
        model = FsdpSpec(arch="llama", world_size=spec["world_size"], with_optimizer=False, **shapes)
        write_fake_pg_dcp(root / "step-1", "torchtitan", model, reference_dir=root / "reference")
    else:
        head_dim = spec["hidden_size"] // spec["num_attention_heads"]
        model = DeepSpeedSpec(stage=3, world_size=spec["world_size"], head_dim=head_dim, **shapes)
        write_fake_pg_deepspeed(root / "ckpt", root / "reference", model)


def ensure_megatron_checkpoint(size: str, cache_dir: Path = DEFAULT_CACHE, *, log=print) -> Checkpoint:
    """A cached Megatron-Core checkpoint (Llama, TP=2) of a ``MEGATRON_SIZES`` size."""
    if size not in MEGATRON_SIZES:
        raise SystemExit(f"no Megatron size {size!r}; choose from {', '.join(MEGATRON_SIZES)}")
    spec = {"family": "llama", "tp": 2, "size": MEGATRON_SIZES[size]}
    root = _cached(
        cache_dir,
        f"megatron-{size}",
        spec,
        ["--megatron", "{staging}"],
        f"the {size} Megatron-Core checkpoint (preset {spec['size']}, TP=2)",
        log,
    )
    return Checkpoint(size, root / "llama_tp2" / "actor", spec, backend="megatron")


def _write_megatron(root: Path, spec: dict) -> None:
    from merge_pipeline_samples.megatron import (
        Variant,
        write_megatron_samples,
    )

    write_megatron_samples(root, [Variant("llama_tp2", spec["family"], tp=spec["tp"], size=spec["size"])], timeout=1800)


def _write(role_dir: Path, spec: dict) -> None:
    import torch

    from merge_pipeline_samples.fsdp import FsdpSpec, write_fsdp_checkpoint
    from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint, write_generated_checkpoint

    fields = dict(spec, dtype=getattr(torch, spec["dtype"]))
    writer = fields.pop("writer", None)
    if writer == "generated":
        write_generated_checkpoint(role_dir, FsdpSpec(**fields))
    elif writer == "fake_pg":
        write_fake_pg_checkpoint(role_dir, FsdpSpec(**fields))
    else:
        write_fsdp_checkpoint(role_dir, FsdpSpec(**fields), timeout=1800)


if __name__ == "__main__":
    if sys.argv[1] == "--megatron":
        _write_megatron(Path(sys.argv[2]), json.loads(sys.argv[3]))
    elif sys.argv[1] == "--format":
        _write_format(Path(sys.argv[2]), json.loads(sys.argv[3]))
    else:
        _write(Path(sys.argv[1]), json.loads(sys.argv[2]))
