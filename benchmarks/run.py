"""The benchmark: merge real FSDP (and Megatron) checkpoints of a few sizes, measure time and memory.

    .venv/bin/python -m benchmarks.run                      # FSDP small, medium, large; 5 repeats
    .venv/bin/python -m benchmarks.run --with-verl          # also verl's merger, side by side
    .venv/bin/python -m benchmarks.run --backends fsdp,megatron  # also Megatron-Core (TP=2)
    .venv/bin/python -m benchmarks.run --quick              # small only, 1 repeat
    .venv/bin/python -m benchmarks.run --checkpoint ROLE_DIR  # your own FSDP checkpoint

Per size and output dtype it measures, in the same run, interleaved, ``--repeat`` times:

* the merge (``python -m merge_pipeline merge ...`` in a fresh child process): wall time from spawn
  to exit, peak RSS (``ru_maxrss`` of that child, from ``wait4``), user + system CPU time;
* the raw baseline: read every rank file once and write as many bytes as the merge wrote, then
  fsync (plain read/write system calls in the already-running runner: no start-up);
* interpreter baselines: children that only import what the merge imports (torch +
  torch.distributed.tensor [+ transformers]): their wall time is the start-up cost, their peak
  RSS the floor any Python merger stands on;
* with ``--with-verl``: ``python -m verl.model_merger merge --backend fsdp`` on the same checkpoint
  (from a separate venv, see benchmarks/verl_env.py), and its output compared tensor by tensor,
  bit for bit, with ours in the same dtype (bf16: verl always casts to bf16).

Before every measurement the rank files are evicted from the page cache (``--cache cold``, the
default: ``posix_fadvise(DONTNEED)``, no root needed, other files stay cached) or read once
(``--cache warm``). The runner itself never imports torch: see benchmarks/measure.py.

The tables use the fastest run of each figure (``--stat min``; medians are shown too and
``--stat median`` uses them): on a shared machine the slower runs measure the neighbours.

Writes ``results.json`` (every sample), ``results.md`` (tables, targets) and
``benchmark_merge.png`` into ``--out``; ``--update-docs`` also refreshes docs/BENCHMARKS.md and
docs/img/.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import report
from benchmarks.checkpoints import (
    DEFAULT_CACHE,
    MEGATRON_SIZES,
    REPO_ROOT,
    SIZES,
    Checkpoint,
    ensure_checkpoint,
    ensure_megatron_checkpoint,
    ensure_world_size_checkpoint,
)
from benchmarks.compare import compare_folders
from benchmarks.measure import prepare_cache, raw_copy, remove, run_child, weight_bytes
from benchmarks.verl_env import (
    DEFAULT_VENV,
    DEFAULT_VERL,
    ensure_verl_venv,
    verl_import_command,
    verl_layout,
    verl_merge_command,
)

# --dtype value -> output dtype of an fp32 checkpoint (fp8: its linear weights; the rest is bf16)
DTYPES = {"auto": "float32", "bfloat16": "bfloat16", "fp8": "float8_e4m3fn"}
INTERPRETERS = {
    "torch": "import torch, torch.distributed.tensor",
    "torch+transformers": "import torch, torch.distributed.tensor, transformers; from transformers import AutoConfig, PretrainedConfig",
    # What a merge imports before it reads a byte: its start-up (import) cost.
    "merge_pipeline": "import merge_pipeline.cli, merge_pipeline.pipeline.merge, merge_pipeline.formats.fsdp.reader",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="small,medium,large",
        help=f"comma-separated, from {', '.join(SIZES)} (default: small,medium,large; 1.1b is TinyLlama's shapes, 4.4 GB)",
    )
    parser.add_argument("--backends", default="fsdp", help="fsdp, megatron or fsdp,megatron (default fsdp)")
    parser.add_argument(
        "--megatron-sizes",
        default="tiny,large",
        help=f"Megatron-Core sizes (TP=2), from {', '.join(MEGATRON_SIZES)} (default: tiny,large)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        action="append",
        help="benchmark this existing FSDP role folder instead of generated sizes (repeatable)",
    )
    parser.add_argument(
        "--world-sizes",
        default="",
        help="also each FSDP size re-saved at these world sizes (e.g. 4,64,1024; torch's fake process group writes them)",
    )
    parser.add_argument("--quick", action="store_true", help="the small size only, one repeat")
    parser.add_argument("--repeat", type=int, default=5, help="measurements per figure (default 5)")
    parser.add_argument(
        "--stat",
        choices=("min", "median"),
        default="min",
        help="statistic the tables and targets use (default min: the least disturbed run; medians are shown too)",
    )
    parser.add_argument(
        "--dtypes", default="auto,bfloat16", help="--dtype values to merge with (default: auto,bfloat16)"
    )
    parser.add_argument(
        "--cache",
        choices=("cold", "drop", "warm"),
        default="cold",
        help="page-cache state before each measurement: rank files evicted (cold, the default), the whole cache dropped (drop: sync; echo 3 > /proc/sys/vm/drop_caches, needs root; start-up reads its libraries from disk too) or rank files read once (warm)",
    )
    parser.add_argument(
        "--with-verl", action="store_true", help="also run verl's merger (creates --verl-venv on first use)"
    )
    parser.add_argument("--verl-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--verl-version", default=DEFAULT_VERL)
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help="where generated checkpoints are kept between runs"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "benchmarks" / "results",
        help="results folder (default benchmarks/results)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument(
        "--update-docs", action="store_true", help="also write the results into docs/BENCHMARKS.md and docs/img/"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="run the benchmark (and so every child) at this niceness; negative needs root (default 0)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed per child process")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.repeat = "small", 1
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nice:  # children inherit it; the raw baseline runs in this process, so it gets it too
        os.setpriority(os.PRIO_PROCESS, 0, args.nice)
    out = args.out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / "scratch"  # merge outputs live here only while measured
    remove(scratch)
    scratch.mkdir()

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not set(backends) <= {"fsdp", "megatron"}:
        raise SystemExit(f"--backends: {args.backends!r}: choose from fsdp, megatron")
    if args.checkpoint:
        checkpoints = [
            Checkpoint(p.name if p.name not in ("actor", "critic") else p.parent.name, p.absolute(), {})
            for p in args.checkpoint
        ]
    else:
        checkpoints = []
        if "fsdp" in backends:
            checkpoints += [
                ensure_checkpoint(size.strip(), args.cache_dir, log=log)
                for size in args.sizes.split(",")
                if size.strip()
            ]
            checkpoints += [
                ensure_world_size_checkpoint(size.strip(), int(world_size), args.cache_dir, log=log)
                for size in args.sizes.split(",")
                if size.strip()
                for world_size in args.world_sizes.split(",")
                if world_size.strip()
            ]
        if "megatron" in backends:
            checkpoints += [
                ensure_megatron_checkpoint(size.strip(), args.cache_dir, log=log)
                for size in args.megatron_sizes.split(",")
                if size.strip()
            ]
    verl = ensure_verl_venv(args.verl_venv, args.verl_version, log=log) if args.with_verl else None
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            raise SystemExit(f"--dtypes: {d!r} is not one of {', '.join(DTYPES)}")

    results = {
        "machine": report.describe_machine(out),
        "settings": {
            "cache": args.cache,
            "repeat": args.repeat,
            "dtypes": dtypes,
            "with_verl": bool(verl),
            "verl_version": args.verl_version if verl else None,
            "python": sys.executable,
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "stat": args.stat,
        },
        "interpreters": {},
        "checkpoints": [],
        "runs": [],
        "comparisons": [],
        "failures": [],  # verl runs that did not complete, with the reason
    }
    results["machine"]["load_before"] = os.getloadavg()

    log("interpreter baselines (start-up and RSS floor)")
    commands = {name: [sys.executable, "-c", code] for name, code in INTERPRETERS.items()}
    if verl:
        commands["verl"] = verl_import_command(verl)
    for name, command in commands.items():
        results["interpreters"][name] = {"command": command, "wall_s": [], "peak_rss_bytes": [], "cpu_s": []}
    for _ in range(args.repeat):
        for name, command in commands.items():
            if args.cache == "drop":  # start-up from a cold cache, as every measured merge has it
                prepare_cache([], args.cache)
            run = run_child(command, cwd=scratch, timeout=args.timeout).check(f"interpreter {name}")
            results["interpreters"][name]["wall_s"].append(run.wall_s)
            results["interpreters"][name]["peak_rss_bytes"].append(run.peak_rss_bytes)
            results["interpreters"][name]["cpu_s"].append(run.cpu_s)

    for checkpoint in checkpoints:
        results["checkpoints"].append(measure_checkpoint(checkpoint, dtypes, verl, args, scratch, results))

    results["machine"]["load_after"] = os.getloadavg()
    # Children's ru_maxrss starts from this process's peak (see measure.run_child): it must stay small.
    results["runner_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    remove(scratch)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    markdown = report.render(results)
    (out / "results.md").write_text(markdown)
    print(markdown)
    if not args.no_plot:
        plot = out / "benchmark_merge.png"
        report.plot(results, plot)
        log(f"plot: {plot}")
    if args.update_docs:
        report.update_docs(results, markdown, None if args.no_plot else out / "benchmark_merge.png")
        log("docs/BENCHMARKS.md updated")
    log(f"results: {out / 'results.json'}, {out / 'results.md'}")
    return 0


def measure_checkpoint(checkpoint: Checkpoint, dtypes: list[str], verl, args, scratch: Path, results: dict) -> dict:
    inputs = checkpoint.model_files
    if not inputs:
        raise SystemExit(f"{checkpoint.role_dir}: no tensor files to merge")
    label = checkpoint.name if checkpoint.backend == "fsdp" else f"megatron-{checkpoint.name}"
    info = {
        "size": label,
        "backend": checkpoint.backend,
        "role_dir": str(checkpoint.role_dir),
        "spec": checkpoint.spec,
        "files": len(inputs),
        "input_bytes": checkpoint.input_bytes,
        "parameters": None,
    }
    log(f"{label}: {len(inputs)} input files, {info['input_bytes'] / 1e9:.3f} GB")
    ours = {d: _series(results, label, "merge_pipeline", DTYPES[d], command_dtype=d) for d in dtypes}
    raws = {d: _series(results, label, "raw", DTYPES[d]) for d in dtypes}
    theirs = _series(results, label, "verl", "bfloat16") if verl else None
    kept: Path | None = None  # our bf16 output of the first repeat, compared with verl's

    for repeat in range(args.repeat):
        for d in dtypes:
            target = scratch / f"ours-{d}"
            prepare_cache(inputs, args.cache)
            command = [
                sys.executable,
                "-m",
                "merge_pipeline",
                "merge",
                "--backend",
                checkpoint.backend,
                "--local_dir",
                str(checkpoint.role_dir),
                "--target_dir",
                str(target),
                "--dtype",
                d,
                "--no-progress",
            ]
            run = run_child(command, cwd=scratch, timeout=args.timeout).check(
                f"merge_pipeline merge --dtype {d} of {label}"
            )
            _record(ours[d], run, output_bytes=weight_bytes(target))
            if info["parameters"] is None:
                info["parameters"] = json.loads((target / "merge_manifest.json").read_text())["parameters"]
            if repeat == 0 and DTYPES[d] == "bfloat16" and verl:
                kept = target.rename(scratch / "ours-bf16-for-comparison")
            else:
                remove(target)

            raw_out = scratch / "raw.bin"
            prepare_cache(inputs, args.cache)
            raws[d]["wall_s"].append(raw_copy(inputs, raw_out, ours[d]["output_bytes"]))
            raws[d]["output_bytes"] = ours[d]["output_bytes"]
            remove(raw_out)
            log(
                f"{label} {d} #{repeat + 1}: merge {run.wall_s:.2f} s, {run.peak_rss_bytes / 2**20:.0f} MiB; raw {raws[d]['wall_s'][-1]:.2f} s"
            )

        if verl and theirs is not None:
            target = scratch / "verl"
            prepare_cache(inputs, args.cache)
            source = checkpoint.role_dir if checkpoint.backend == "fsdp" else verl_layout(checkpoint.role_dir, scratch)
            run = run_child(
                verl_merge_command(verl, checkpoint.backend, source, target), cwd=scratch, timeout=args.timeout
            )
            if run.returncode != 0:
                reason = _last_error(run.output)
                results["failures"].append(
                    {
                        "size": label,
                        "tool": "verl",
                        "returncode": run.returncode,
                        "reason": reason,
                        "output_tail": run.output[-3000:],
                    }
                )
                log(f"{label}: verl's merger failed ({run.returncode}): {reason}")
                results["runs"].remove(theirs)
                theirs = None
                remove(target)
                if kept is not None:
                    remove(kept)
                    kept = None
                continue
            flush_started = time.perf_counter()
            os.sync()  # verl does not fsync; its dirty pages must not land in our next measurement
            theirs.setdefault("flush_s", []).append(time.perf_counter() - flush_started)
            _record(theirs, run, output_bytes=weight_bytes(target))
            log(
                f"{label} verl #{repeat + 1}: {run.wall_s:.2f} s (+{theirs['flush_s'][-1]:.2f} s to flush), {run.peak_rss_bytes / 2**20:.0f} MiB"
            )
            if repeat == 0 and kept is not None:
                comparison = compare_folders(kept, target)
                results["comparisons"].append(
                    {
                        "size": label,
                        "dtype": "bfloat16",
                        "identical": comparison.identical,
                        "tensors": comparison.tensors,
                        "summary": comparison.summary(),
                    }
                )
                log(f"{label}: ours vs verl (bf16): {comparison.summary()}")
                remove(kept)
                kept = None
            remove(target)
    if kept is not None:
        remove(kept)
    if info["parameters"] is None:
        info["parameters"] = 0
    return info


def _last_error(output: str) -> str:
    """The last line of a traceback (``SomeError: message``), or the last non-empty line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line.split(":", 1)[0] or "Exception" in line.split(":", 1)[0]:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def _series(results: dict, size: str, tool: str, dtype: str, command_dtype: str | None = None) -> dict:
    series = {
        "size": size,
        "tool": tool,
        "dtype": dtype,
        "wall_s": [],
        "peak_rss_bytes": [],
        "cpu_s": [],
        "output_bytes": None,
    }
    if command_dtype:
        series["dtype_flag"] = command_dtype
    results["runs"].append(series)
    return series


def _record(series: dict, run, *, output_bytes: int) -> None:
    series["wall_s"].append(run.wall_s)
    series["peak_rss_bytes"].append(run.peak_rss_bytes)
    series["cpu_s"].append(run.cpu_s)
    series["output_bytes"] = output_bytes


if __name__ == "__main__":
    sys.exit(main())
