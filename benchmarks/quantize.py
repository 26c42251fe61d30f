"""What ``--quantize`` costs: the merge straight into a compressed-tensors scheme against the bf16 merge of the
same checkpoint, and against what it replaces (the bf16 merge, then llm-compressor's ``model_free_ptq`` over it).

    .venv/bin/python -m benchmarks.quantize --size large --scheme W4A16 --repeat 2

Per repeat, in the same minutes of the machine, each a fresh child process (warm page cache): ``merge --dtype
bfloat16``; ``merge --quantize SCHEME``; ``model_free_ptq`` on the bf16 folder (``.venv-llmcompressor``, CPU,
the ignore list the quantized merge wrote). Wall from spawn to exit, CPU time (user + system) and peak RSS from
``wait4``; the table keeps the fastest run of each, and each repeat's line says its walls and the load average.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, REPO_ROOT, SIZES, ensure_checkpoint
from benchmarks.measure import remove, run_child

MERGE = [str(REPO_ROOT / ".venv" / "bin" / "python"), "-m", "merge_pipeline", "merge", "--no-progress"]
REFERENCE = [str(REPO_ROOT / ".venv-llmcompressor" / "bin" / "python"), "merge_pipeline_samples/model_free_ptq.py"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.quantize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="large", choices=sorted(SIZES))
    parser.add_argument("--scheme", default="W4A16")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    checkpoint = ensure_checkpoint(args.size, args.cache_dir)
    source = ["--local_dir", str(checkpoint.role_dir)]
    best: dict[str, tuple[float, float, int]] = {}
    with tempfile.TemporaryDirectory(dir=args.cache_dir) as scratch:
        out = Path(scratch)
        for _ in range(args.repeat):
            for path in out.iterdir():
                remove(path)
            runs = {
                "bf16 merge": run_child([*MERGE, *source, "--target_dir", str(out / "bf16"), "--dtype", "bfloat16"]),
                f"merge --quantize {args.scheme}": run_child(
                    [*MERGE, *source, "--target_dir", str(out / "quantized"), "--quantize", args.scheme]
                ),
            }
            ignore = json.loads((out / "quantized" / "config.json").read_text())["quantization_config"]["ignore"]
            reference = [*REFERENCE, str(out / "reference"), str(out / "bf16"), json.dumps(ignore), args.scheme]
            runs["model_free_ptq of the bf16 merge"] = run_child(reference, cwd=REPO_ROOT)
            for name, run in runs.items():
                run.check(name)
                if name not in best or run.wall_s < best[name][0]:
                    best[name] = (run.wall_s, run.cpu_s, run.peak_rss_bytes)
            walls = ", ".join(f"{name} {run.wall_s:.1f} s (CPU {run.cpu_s:.1f} s)" for name, run in runs.items())
            print(f"repeat: {walls}; load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    bf16_wall = best["bf16 merge"][0]
    both = bf16_wall + best["model_free_ptq of the bf16 merge"][0]
    print(f"| {args.size} FSDP checkpoint, {args.scheme} | wall (s) | vs bf16 merge | CPU (s) | peak RSS (GB) |")
    print("|---|---|---|---|---|")
    for name, (wall, cpu, rss) in best.items():
        print(f"| {name} | {wall:.1f} | {wall / bf16_wall:.2f}x | {cpu:.1f} | {rss / 1e9:.2f} |")
    print(f"| bf16 merge + model_free_ptq | {both:.1f} | {both / bf16_wall:.2f}x | | |")


if __name__ == "__main__":
    main()
