"""Wall time and peak RSS of a merge against the world size the same weights were saved at.

    .venv/bin/python -m benchmarks.world_sizes --size large --world-sizes 4,64,1024 --repeat 3 \\
        [--formats fsdp,dcp,deepspeed] [--compare-with /path/to/other/checkout] [--with-verl] [--plan] \\
        [--plot docs/img/world_sizes.png]
    .venv/bin/python -m benchmarks.world_sizes --formats megatron --size large --world-sizes 64 --plan

Each world size is the ``--size`` checkpoint re-saved by torch's fake process group
(``benchmarks.checkpoints.ensure_world_size_checkpoint``); each merge is a fresh
``python -m merge_pipeline merge --dtype bfloat16`` child (wall from spawn to exit, peak RSS and
CPU from ``wait4``), warm page cache, the runs of every world size (and of ``--compare-with``, the
same command with that checkout first on PYTHONPATH: e.g. main before a change) interleaved, so
the ratios come from the same minutes of a shared machine. ``--with-verl`` adds verl's
``model_merger`` (its venv from ``benchmarks.verl_env``; bf16 output, as ours) to the same rotation;
its dirty pages are synced after its run, outside its time, as in ``benchmarks.run``. ``--plan`` adds
the planning alone (``open_checkpoint`` in its own child: ``benchmarks/plan_time.py``, wall and CPU
seconds without the imports, peak RSS from ``wait4``) beside each merge by a checkout. The table uses the fastest run.
Megatron-Core is saved at world size 64 only: TP=8 x PP=8 (``--size large``, ~258M) or TP=2 x EP=8 x
PP=4 (``--size moe128``, 128 experts), by megatron-core's own code (``megatron_fake_pg``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, REPO_ROOT, ensure_format_world_size_checkpoint
from benchmarks.measure import prepare_cache, remove, run_child
from benchmarks.verl_env import DEFAULT_VENV, DEFAULT_VERL, ensure_verl_venv, verl_merge_command


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.world_sizes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large")
    parser.add_argument("--world-sizes", default="4,64,1024")
    parser.add_argument(
        "--formats",
        default="fsdp",
        help="checkpoint formats, each saved at every world size by its own save code: fsdp, dcp (torchtitan), deepspeed (ZeRO-3), megatron (world size 64)",
    )
    parser.add_argument("--plan", action="store_true", help="also time the planning alone, in its own child")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compare-with", type=Path, help="another checkout of merge_pipeline, measured alongside")
    parser.add_argument("--compare-label", default="other checkout", help="its name in the table and plot")
    parser.add_argument(
        "--with-verl", action="store_true", help="also verl's merger (creates --verl-venv on first use)"
    )
    parser.add_argument("--verl-venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--verl-version", default=DEFAULT_VERL)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)

    world_sizes = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    checkpoints = {
        (f, w): ensure_format_world_size_checkpoint(f, args.size, w, args.cache_dir)
        for f in formats
        for w in world_sizes
    }
    versions = {"this checkout": REPO_ROOT}
    if args.compare_with:
        versions = {args.compare_label: args.compare_with.resolve(), **versions}
    verl = ensure_verl_venv(args.verl_venv, args.verl_version) if args.with_verl else None
    mergers = [*versions, *([f"verl {args.verl_version}"] if verl else [])]
    # One table row per merger (and per format, when other formats than FSDP are measured); verl's
    # merger reads FSDP only.
    label = {
        (f, m): m if formats == ["fsdp"] else f"{f}, {m}"
        for f in formats
        for m in mergers
        if m in versions or f == "fsdp"
    }
    samples: dict[str, dict[int, list[dict]]] = {name: {w: [] for w in world_sizes} for name in label.values()}
    with tempfile.TemporaryDirectory(prefix="world-sizes-") as scratch:
        for repeat in range(args.repeat):
            for (f, w), checkpoint in checkpoints.items():
                for merger in (m for m in mergers if (f, m) in label):
                    name = label[f, merger]
                    target = Path(scratch) / "out"
                    prepare_cache(checkpoint.model_files, "warm")
                    if merger in versions:
                        command = [
                            sys.executable,
                            "-m",
                            "merge_pipeline",
                            "merge",
                            "--local_dir",
                            str(checkpoint.role_dir),
                        ]
                        command += ["--target_dir", str(target), "--dtype", "bfloat16", "--no-progress"]
                        command += list(checkpoint.merge_flags)
                        env = {**os.environ, "PYTHONPATH": str(versions[merger])}
                    else:
                        command, env = verl_merge_command(verl, "fsdp", checkpoint.role_dir, target), None
                    run = run_child(command, cwd=Path(scratch), env=env).check(f"merge of world size {w} by {name}")
                    os.sync()  # verl does not fsync: its dirty pages must not land in the next run
                    remove(target)
                    sample = {"wall_s": run.wall_s, "cpu_s": run.cpu_s, "peak_rss_mb": run.peak_rss_bytes / 1e6}
                    if args.plan and merger in versions:
                        sample |= _plan(checkpoint, env, Path(scratch))
                    samples[name][w].append(sample)
                    print(f"repeat {repeat + 1}, world size {w}, {name}: {json.dumps(sample)}", flush=True)
    print(table(samples, world_sizes))
    if args.json:
        args.json.write_text(json.dumps(samples, indent=1))
    if args.plot:
        plot(samples, world_sizes, args.size, args.plot)


def _plan(checkpoint, env: dict, cwd: Path) -> dict:
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "plan_time.py"), str(checkpoint.role_dir)]
    run = run_child([*command, *checkpoint.merge_flags], cwd=cwd, env=env).check("planning")
    [line] = [line for line in run.output.splitlines() if line.startswith('{"plan_s"')]
    timed = json.loads(line)
    return {"plan_s": timed["plan_s"], "plan_cpu_s": timed["plan_cpu_s"], "plan_peak_rss_mb": run.peak_rss_bytes / 1e6}


def _best(runs: list[dict]) -> dict:
    return {key: min(r[key] for r in runs) for key in runs[0]}


def table(samples: dict, world_sizes: list[int]) -> str:
    verl = next((label for label in samples if "verl" in label), None)
    planned = any("plan_s" in run for by_size in samples.values() for runs in by_size.values() for run in runs)
    lines = [
        f"| code | world size | wall s | CPU s | peak RSS MB | wall / world size {world_sizes[0]} | CPU / world size {world_sizes[0]} |"
        + (" wall / verl's |" if verl else "")
        + (" plan s | plan CPU s | plan peak RSS MB |" if planned else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if verl else "") + ("---:|---:|---:|" if planned else ""),
    ]
    for version, by_size in samples.items():
        first = _best(by_size[world_sizes[0]])
        for w in world_sizes:
            best = _best(by_size[w])
            line = f"| {version} | {w} | {best['wall_s']:.1f} | {best['cpu_s']:.1f} | {best['peak_rss_mb']:.0f} | {best['wall_s'] / first['wall_s']:.2f}x | {best['cpu_s'] / first['cpu_s']:.2f}x |"
            if verl:
                line += f" {best['wall_s'] / _best(samples[verl][w])['wall_s']:.2f}x |"
            if planned:
                plan = f" {best['plan_s']:.2f} | {best['plan_cpu_s']:.2f} | {best['plan_peak_rss_mb']:.0f} |"
                line += plan if "plan_s" in best else " | | |"
            lines.append(line)
    return "\n".join(lines)


def plot(samples: dict, world_sizes: list[int], size: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (wall, cpu, memory) = plt.subplots(1, 3, figsize=(14, 4))
    for version, by_size in samples.items():
        best = [_best(by_size[w]) for w in world_sizes]
        wall.plot(world_sizes, [b["wall_s"] for b in best], marker="o", label=version)
        cpu.plot(world_sizes, [b["cpu_s"] for b in best], marker="o", label=version)
        memory.plot(world_sizes, [b["peak_rss_mb"] for b in best], marker="o", label=version)
    labels = ("wall time (s, fastest run)", "CPU time (s, user + system, least)", "peak RSS (MB)")
    for axes, label in zip((wall, cpu, memory), labels):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("world size (rank files)")
        axes.set_ylabel(label)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    wall.legend(fontsize=8)
    figure.suptitle(f"{size} FSDP checkpoint, fp32 -> bf16, warm cache: the same weights at each world size")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
