"""A checkpoint larger than the machine's memory: Llama-3-8B shapes, fp32, FSDP2 world size 8, merged to bf16.

    .venv/bin/python -m benchmarks.larger_than_memory [--layers 24] [--scratch DIR] [--verl] [--keep]

Llama-3-8B's shapes (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256) with
``--layers`` decoder layers (the real model has 32: 32 GB of fp32 rank files, more than a small
machine's disk holds beside its output). The rank files are written by the fake process group
writer one rank at a time, each rank's rows drawn from a seeded generator
(``write_generated_checkpoint``), so writing needs one rank file's share of memory, not the model's.

Then, one at a time (never two big I/O jobs at once), each with the rank files evicted from the page
cache first (``posix_fadvise(DONTNEED)``: cold reads without root):

- the raw floor: read every rank file once and write + fsync the bf16 output's bytes, in one
  already running process (``measure.raw_copy``), plus a torch interpreter's start-up;
- ``python -m merge_pipeline merge --dtype bfloat16``: wall, CPU, peak RSS; the embeddings, the first
  layer and the LM head of the output are compared bit for bit with the generated tensors cast to bf16;
- lossless fp32 (``--dtype float32``) only if the disk holds a second copy of the rank files;
- with ``--verl``: verl 0.9.1's ``model_merger merge --backend fsdp`` under ``prlimit --as`` (its
  address space capped, so it fails on its own allocation rather than make the kernel kill another
  process), while a watchdog kills it if the disk's free space falls under the reserve.

Everything written is deleted at the end (``--keep`` keeps the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.checkpoints import REPO_ROOT, parameter_count, spec_for
from benchmarks.measure import ChildRun, evict, raw_copy, remove, run_child, weight_bytes

# benchmarks.checkpoints' "8b" (Llama-3-8B, world size 8), its layer count left to --layers
LLAMA3_8B = {k: v for k, v in spec_for("8b").items() if k not in ("dtype", "writer", "num_layers")}
RESERVE = 5 * 10**9  # free disk planned to be left at every point, for everyone else on the machine
EMERGENCY = 2 * 10**9  # a child is killed if others' writes bring the free space under this
GB = 10**9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.larger_than_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--scratch", type=Path, default=Path(os.environ.get("BENCH_SCRATCH", tempfile.gettempdir())))
    parser.add_argument("--verl", action="store_true", help="also run verl 0.9.1's merger, memory-capped")
    parser.add_argument("--verl-address-space", default="16G", help="prlimit --as for verl (default 16G)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (the outputs are always removed)")
    args = parser.parse_args(argv)

    spec = {**LLAMA3_8B, "num_layers": args.layers}
    params = parameter_count(spec)
    rank_bytes, bf16_bytes = 4 * params, 2 * params
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    _need_free(args.scratch, rank_bytes + bf16_bytes, "the rank files and the bf16 output")
    root = Path(tempfile.mkdtemp(prefix="larger-than-memory-", dir=args.scratch))
    print(
        f"Llama-3-8B shapes, {args.layers} layers: {params / 1e9:.2f}B parameters, {rank_bytes / GB:.1f} GB of fp32 "
        f"rank files at world size 8 ({rank_bytes / memory:.2f}x this machine's {memory / GB:.1f} GB of memory), "
        f"{bf16_bytes / GB:.1f} GB of bf16 output; scratch {root}",
        flush=True,
    )
    rows = []
    try:
        role_dir = root / "global_step_1" / "actor"
        write = run_child(
            [sys.executable, "-m", "benchmarks.larger_than_memory", "--write", str(role_dir), json.dumps(spec)],
            stop_when=DiskGuard(root),
        )
        write.check("writing the checkpoint")
        rank_files = sorted(role_dir.glob("model_world_size_*_rank_*.pt"))
        on_disk = sum(p.stat().st_size for p in rank_files)
        print(
            f"wrote {len(rank_files)} rank files, {on_disk / GB:.1f} GB, in {write.wall_s:.0f} s ({write.peak_rss_bytes / GB:.2f} GB peak RSS)",
            flush=True,
        )

        evict(rank_files)
        start_up = run_child([sys.executable, "-c", "import torch"]).check("torch start-up").wall_s
        _need_free(root, bf16_bytes, "the raw floor's output")
        floor_file = root / "floor.bin"
        floor = raw_copy(rank_files, floor_file, bf16_bytes)
        remove(floor_file)
        rows.append(
            (
                "raw floor: read the rank files, write + fsync the bf16 bytes, + torch start-up",
                floor + start_up,
                None,
                None,
                "",
            )
        )
        print(f"raw floor {floor:.1f} s + torch start-up {start_up:.1f} s", flush=True)

        for dtype, needs in (("bfloat16", bf16_bytes), ("float32", rank_bytes)):
            if shutil.disk_usage(root).free < needs + RESERVE:
                rows.append(
                    (
                        f"merge_pipeline --dtype {dtype}",
                        None,
                        None,
                        None,
                        f"not run: needs {(needs + RESERVE) / GB:.0f} GB free, {shutil.disk_usage(root).free / GB:.0f} GB are",
                    )
                )
                continue
            evict(rank_files)
            target = root / f"merged-{dtype}"
            run = _merge(role_dir, target, dtype)
            note = _check_output(target, spec, dtype) if run.returncode == 0 else _last_line(run.output)
            if run.returncode == 0:
                note += f"; {weight_bytes(target) / GB:.1f} GB written"
            rows.append((f"merge_pipeline --dtype {dtype}", run.wall_s, run.cpu_s, run.peak_rss_bytes, note))
            print(
                f"merge_pipeline {dtype}: {run.wall_s:.1f} s, CPU {run.cpu_s:.1f} s, peak RSS {run.peak_rss_bytes / GB:.2f} GB: {note}",
                flush=True,
            )
            remove(target)

        if args.verl:
            rows.append(_verl(role_dir, root / "verl-out", rank_files, args.verl_address_space))
            print(rows[-1], flush=True)
    finally:
        if args.keep:
            print(f"kept {root / 'global_step_1'}")
        else:
            remove(root)
    print("| run | wall s | CPU s | peak RSS GB | note |")
    print("|---|---:|---:|---:|---|")
    for name, wall, cpu, rss, note in rows:
        print(f"| {name} | {_num(wall)} | {_num(cpu)} | {_num(rss and rss / GB, 2)} | {note} |")


def _merge(role_dir: Path, target: Path, dtype: str) -> ChildRun:
    command = [sys.executable, "-m", "merge_pipeline", "merge", "--local_dir", str(role_dir)]
    command += ["--target_dir", str(target), "--dtype", dtype, "--no-progress"]
    return run_child(command, cwd=REPO_ROOT, stop_when=DiskGuard(target.parent))


def _check_output(target: Path, spec: dict, dtype: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.larger_than_memory", "--check", str(target), json.dumps(spec), dtype],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    return done.stdout.strip() if done.returncode == 0 else f"CHECK FAILED: {_last_line(done.stdout + done.stderr)}"


def _verl(role_dir: Path, target: Path, rank_files: list[Path], address_space: str) -> tuple:
    from benchmarks.verl_env import ensure_verl_venv, verl_merge_command

    python = ensure_verl_venv()
    evict(rank_files)
    command = ["prlimit", f"--as={_bytes(address_space)}", *verl_merge_command(python, "fsdp", role_dir, target)]
    guard = DiskGuard(target.parent)
    run = run_child(command, cwd=REPO_ROOT, stop_when=guard)
    written = weight_bytes(target) / GB if target.exists() else 0.0
    remove(target)
    outcome = "finished" if run.returncode == 0 else f"exit {run.returncode}: {guard.stopped or _last_line(run.output)}"
    note = f"verl 0.9.1 under prlimit --as={address_space}: {outcome}; {written:.1f} GB written"
    return ("verl 0.9.1 model_merger --backend fsdp", run.wall_s, run.cpu_s, run.peak_rss_bytes, note)


class DiskGuard:
    """``run_child``'s ``stop_when``: True once the disk's free space falls under ``EMERGENCY`` (others
    on the machine filled it meanwhile): the child is killed rather than fill the disk for everyone."""

    def __init__(self, folder: Path):
        self.folder, self.stopped = folder, ""

    def __call__(self) -> bool:
        if not self.stopped and shutil.disk_usage(self.folder).free < EMERGENCY:
            self.stopped = f"killed by the benchmark: free disk under {EMERGENCY / GB:.0f} GB"
        return bool(self.stopped)


def _need_free(folder: Path, planned: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < planned + RESERVE:
        raise SystemExit(
            f"{folder}: {free / GB:.1f} GB free, {what} need {planned / GB:.1f} GB and {RESERVE / GB:.0f} GB stay free: use fewer --layers"
        )


def _bytes(size: str) -> int:
    units = {"G": 1 << 30, "M": 1 << 20}
    return int(float(size[:-1]) * units[size[-1]]) if size[-1] in units else int(size)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[-1].split())[:300] if lines else "(no output)"


def _num(value, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


# --- child processes (the runner itself never imports torch: its peak RSS would carry into the children's) ---


def _write(role_dir: Path, spec: dict) -> None:
    import torch

    from merge_pipeline_samples.fsdp import FsdpSpec
    from merge_pipeline_samples.fsdp_fake_pg import write_generated_checkpoint

    write_generated_checkpoint(role_dir, FsdpSpec(**spec, dtype=torch.float32))


def _check(target: Path, spec: dict, dtype: str) -> None:
    """The embeddings, every tensor of layer 0 and the LM head, bit for bit against the generated ones."""
    import torch
    import transformers
    from safetensors import safe_open

    from merge_pipeline_samples.fsdp import FsdpSpec, _causal_lm_config
    from merge_pipeline_samples.fsdp_fake_pg import generated_tensor

    fsdp_spec = FsdpSpec(**spec, dtype=torch.float32)
    with torch.device("meta"):
        shapes = transformers.AutoModelForCausalLM.from_config(_causal_lm_config(fsdp_spec)).state_dict()
    index_file = target / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())["weight_map"] if index_file.exists() else {}
    chosen = [n for n in shapes if ".layers." not in n or ".layers.0." in n]
    for name in chosen:
        with safe_open(target / index.get(name, "model.safetensors"), "pt") as f:
            merged = f.get_tensor(name)
        expected = generated_tensor(fsdp_spec, list(shapes).index(name), shapes[name]).to(getattr(torch, dtype))
        if not torch.equal(merged, expected):
            raise SystemExit(f"{name}: differs from the generated tensor")
    print(f"bit-exact: {len(chosen)} tensors checked (embeddings, layer 0, norm, LM head)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        _write(Path(sys.argv[2]), json.loads(sys.argv[3]))
    elif sys.argv[1:2] == ["--check"]:
        _check(Path(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4])
    else:
        main()
