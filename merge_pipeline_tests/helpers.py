"""Small helpers shared by the tests (fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from merge_pipeline.cli import main
from merge_pipeline.hf.config import CheckpointConfig
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import CheckpointPlan
from merge_pipeline_samples.deepspeed import DeepSpeedSpec
from merge_pipeline_samples.fsdp import FsdpSpec

# A one-layer Llama small enough for thousands of rank files: 1003 vocab rows split unevenly over most world sizes.
TINY_LLAMA = FsdpSpec(
    arch="llama",
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    vocab_size=1003,
    num_attention_heads=2,
    num_key_value_heads=1,
    with_optimizer=False,
)


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> digest): 'untouched' made checkable."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def load_safetensors_dir(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every top-level ``*.safetensors`` file in ``folder``."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = f.get_tensor(name)
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    )


def assert_loads_every_stored_value(folder: Path) -> None:
    """transformers' ``from_pretrained`` with ``dtype="auto"`` (its default) holds every stored tensor unaltered:
    equal to it, and bit for bit the stored tensor again in the stored dtype (widened exactly, never rounded)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    model, info = getattr(transformers, config.architectures[0]).from_pretrained(
        folder, dtype="auto", output_loading_info=True
    )
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    loaded = model.state_dict()
    for name, stored in load_safetensors_dir(folder).items():
        value = loaded[name]
        assert torch.equal(value, stored.to(value.dtype)) and same_bits(value.to(stored.dtype), stored), name


def assert_bit_exact(merged: dict[str, torch.Tensor] | Path, reference: dict[str, torch.Tensor] | Path) -> None:
    """The same tensor names, each with the same dtype, shape and bits. A folder stands for its safetensors files."""
    merged, reference = (load_safetensors_dir(t) if isinstance(t, Path) else t for t in (merged, reference))
    assert set(merged) == set(reference), sorted(set(merged) ^ set(reference))
    for name, tensor in reference.items():
        assert same_bits(merged[name], tensor), name


def megatron_plan(role_dir: Path, **options) -> CheckpointPlan:
    """The Megatron reader's plan of ``role_dir`` with these merge options (as ``--backend megatron``)."""
    # megatron-core's types: only for the tests that need them
    from merge_pipeline.formats.megatron.reader import READER

    options = MergeOptions(**options)
    return READER.plan(Path(role_dir), options, CheckpointConfig.of(role_dir, options))


def config_says_tied(role_dir: Path) -> Path:
    """Switch an FSDP checkpoint's config.json to tie_word_embeddings true, as a mismatched config would be."""
    path = role_dir / "huggingface" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "tie_word_embeddings": True}))
    return path


def config_claims_one_more_layer(role_dir: Path) -> str:
    """Make an FSDP checkpoint's config.json describe one layer more than its rank files hold (the reader
    cannot tell; the merged folder then fails the meta-device check). Returns a weight the folder lacks."""
    path = role_dir / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    layers = config["num_hidden_layers"]
    path.write_text(
        json.dumps({**config, "num_hidden_layers": layers + 1, "layer_types": config["layer_types"][:1] * (layers + 1)})
    )
    return f"model.layers.{layers}.input_layernorm.weight"


def cli_merge_command(role_dir: Path, target: Path, *flags: str) -> list[str]:
    """``merge`` in a fresh interpreter, for tests that limit, time or kill the process."""
    return [
        sys.executable,
        "-m",
        "merge_pipeline",
        "merge",
        "--local_dir",
        str(role_dir),
        "--target_dir",
        str(target),
        "--no-progress",
        *flags,
    ]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``merge-pipeline`` in this process; returns (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def merge(capsys, local_dir: Path, target: Path, *flags) -> tuple[int, str, str]:
    """``merge-pipeline merge`` of ``local_dir`` into ``target`` in this process, without progress bars;
    returns (exit code, stdout, stderr)."""
    return run_cli(capsys, "merge", "--local_dir", local_dir, "--target_dir", target, "--no-progress", *flags)


def merge_ok(capsys, local_dir: Path, target: Path, *flags) -> str:
    """A ``merge`` that must succeed; returns its stdout."""
    code, out, err = merge(capsys, local_dir, target, *flags)
    assert code == 0, err
    return out


def merge_error(capsys, local_dir: Path, target: Path, *flags) -> str:
    """A ``merge`` that must fail with exit code 1, one error line and no ``target``; returns that line."""
    code, _, err = merge(capsys, local_dir, target, *flags)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert not target.exists()
    return lines[0]


def write_with_release(venv: str, writer: str, root: Path, *args: str, timeout: int = 900) -> Path:
    """Run the sample writer ``merge_pipeline_samples/<writer>`` with the isolated venv that
    ``scripts/test.sh`` builds for that library (``.venv-torchtitan``, ``.venv-nemo``, ``.venv-bridge``),
    so the checkpoint in ``root`` is written by the library's own save code, at its pinned release."""
    repo = Path(__file__).resolve().parents[1]
    python = repo / venv / "bin" / "python"
    assert python.is_file(), f"{python} missing: run scripts/test.sh (it builds it)"
    done = subprocess.run(
        [python, "-W", "ignore", repo / "merge_pipeline_samples" / writer, root, *args],
        timeout=timeout,
        capture_output=True,
        text=True,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, f"{writer} under {venv} failed:\n{done.stderr[-4000:]}"
    return root


def cached_release_fixture(venv: str, writer: str, *args: str, sources: tuple[str, ...], timeout: int = 900) -> Path:
    """``write_with_release`` once per venv: the folder is kept in ``<venv>/fixtures/<key>/``, the key a hash of the
    venv's stamp (what ``scripts/setup_<library>.sh`` installed), the writer's arguments and the files under
    ``sources`` (paths from the repository root: the writer and what it imports from the repository). Rebuilding
    the venv, or changing any of those, writes it afresh. Never modify the folder returned."""
    repo = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256((repo / venv / "stamp").read_bytes() + "\0".join((writer, *args)).encode())
    for source in sources:
        for path in sorted(p for p in (repo / source).rglob("*") if p.is_file() and "__pycache__" not in p.parts) or [
            repo / source
        ]:
            digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes())
    cached = repo / venv / "fixtures" / digest.hexdigest()[:16]
    if not cached.is_dir():
        fresh = cached.with_name(cached.name + f".{os.getpid()}")
        try:
            write_with_release(venv, writer, fresh, *args, timeout=timeout)
        except BaseException:
            shutil.rmtree(fresh, ignore_errors=True)
            raise
        fresh.rename(cached)  # whole or not at all
    return cached


TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@contextlib.contextmanager
def torchrun(nproc: int, *args, command: str = "merge") -> Iterator[subprocess.Popen]:
    """torchrun of ``merge-pipeline <command>`` in its own process group, killed with all its ranks whatever the test does."""
    command = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "merge_pipeline",
        command,
        *map(str, args),
    ]
    run = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
    )
    try:
        yield run
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.communicate()


def assert_torchrun_writes_what_one_process_writes(capsys, role_dir: Path, out: Path, *flags) -> None:
    """Two torchrun ranks, each writing its own shards, publish the folder one process publishes, byte for byte
    (more than two weight files, so that both ranks write)."""
    merge_ok(capsys, role_dir, out / "single", *flags)
    with torchrun(2, "--local_dir", role_dir, "--target_dir", out / "multi", *flags) as run:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert tree_digest(out / "multi") == tree_digest(out / "single")
    assert len(list((out / "single").glob("model-*.safetensors"))) > 2


_HOLD_LOCK = """
import sys
from merge_pipeline.engine.publish import locked_target
with locked_target(sys.argv[1], source=sys.argv[2], overwrite=True) as locked:
    staging = locked.new_staging()
    (staging / "model.safetensors").write_bytes(b"a merge half way")
    print("holding", flush=True)
    sys.stdin.read()  # until the test closes stdin
"""


@contextlib.contextmanager
def merge_in_progress(target: Path, source: Path) -> Iterator[subprocess.Popen]:
    """Another process holding ``target``'s lock through the engine's API, as a running merge does, with a half-written staging."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(target), str(source)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "holding\n", "the lock holder did not start"
        yield holder
    finally:
        holder.communicate(timeout=60)


# --- the DCP and DeepSpeed samples (fixtures dcp_sample, deepspeed_checkpoints in conftest.py) ---

# The folder a user points the merge at, as each trainer lays it out.
DCP_FOLDERS = {
    "torchtitan": "checkpoint/step-10",
    "accelerate": "output/checkpoint-1",
    "nemo_rl": "results/step_1/policy",
    "nemo_automodel": "checkpoints/epoch_0_step_1",
    "nemo_automodel_safetensors": "checkpoints/epoch_0_step_2",
}


@dataclass(frozen=True)
class DcpSample:
    folder: Path  # what the merge is pointed at
    model_dir: Path  # the DCP folder holding the model (.metadata)
    original_dir: Path  # the HF model training started from: weights, config, tokenizer


FROZEN = ("model.norm.weight", "model.layers.0.input_layernorm.weight")
VARIANTS = {
    # OpenRLHF's ckpt folder: no HF files beside it, the config comes from --hf_model_path.
    "zero1": DeepSpeedSpec(stage=1, hf_files=False, frozen=FROZEN),
    # OpenRLHF's defaults: its Actor wrapper (names model.model.*), a bf16 module (frozen parameters stay
    # bf16) with fp32 master weights in the optimizer files, ZeRO 2, no HF files in the ckpt folder.
    "openrlhf-zero2-bf16-frozen": DeepSpeedSpec(stage=2, bf16=True, frozen=FROZEN, hf_files=False, openrlhf_actor=True),
    "zero2-tied-frozen": DeepSpeedSpec(stage=2, tie_word_embeddings=True, frozen=FROZEN),
    "zero3-tied-frozen": DeepSpeedSpec(stage=3, tie_word_embeddings=True, frozen=FROZEN),
}


class TensorInPieces:
    """A tensor source yielding the weight in pieces that end mid-row and mid-band, as file reads do."""

    def __init__(self, tensor: torch.Tensor, piece: int):
        self.tensor, self.piece = tensor, piece

    def byte_runs(self):
        return None

    def pieces(self):
        flat = self.tensor.reshape(-1)
        for start in range(0, flat.numel(), self.piece):
            yield flat[start : start + self.piece].clone()
