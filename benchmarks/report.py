"""Tables, targets and the plot, from a results.json (``python -m benchmarks.report results.json`` re-renders)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
from pathlib import Path

from benchmarks.checkpoints import REPO_ROOT

DOCS = REPO_ROOT / "docs" / "BENCHMARKS.md"
DOCS_PLOT = REPO_ROOT / "docs" / "img" / "benchmark_merge.png"
BEGIN, END = "<!-- BEGIN RESULTS (written by python -m benchmarks.run --update-docs) -->", "<!-- END RESULTS -->"
OURS_INTERPRETER = "merge_pipeline"  # the start-up of a merge (older results.json: torch+transformers)
MB, GB = 1e6, 1e9

# Targets: flat in model size, against verl, lossless against a raw copy, fp8 against bf16
MARGINAL_MAX = 1.5
FP8_OVER_BF16_MAX = 1.3  # quantizing on the way to disk costs at most 30% over the bf16 cast
RSS_GROWTH_MAX = 400 * MB
VERL_WALL_FRACTION, VERL_RSS_FRACTION = 1 / 3, 1 / 5
RSS_OVER_TORCH_MAX = 0.5 * GB
WALL_OVER_IO_MAX = 2.0
LOSSLESS_OVER_COPY_MAX = 1.25  # lossless fp32 wall against the raw copy plus a torch interpreter's start-up
PEAK_RSS_MAX = 0.5 * GB


# --- machine ---------------------------------------------------------------------------------------


def describe_machine(path: Path) -> dict:
    info = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": _meminfo("MemTotal"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("merge_pipeline", "torch", "transformers", "safetensors")},
        "commit": _git_commit(),
    }
    info.update(_disk(path))
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The repository's commit, with ``+changes`` when the engine's files differ from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "merge_pipeline"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def _disk(path: Path) -> dict:
    out: dict = {}
    try:
        df = (
            subprocess.run(["df", "-T", "-B1", str(path)], capture_output=True, text=True, check=True)
            .stdout.splitlines()[1]
            .split()
        )
        out.update(disk_device=df[0], filesystem=df[1], disk_bytes=int(df[2]))
        name = Path(df[0]).name
        ls = subprocess.run(
            ["lsblk", "-dno", "NAME,ROTA,TYPE,MODEL", f"/dev/{name}"], capture_output=True, text=True, check=False
        )
        if ls.returncode == 0 and ls.stdout.strip():
            fields = ls.stdout.split(None, 3)
            out["rotational"] = fields[1] == "1"
            out["disk_model"] = fields[3].strip() if len(fields) > 3 else ""
        virtio = name.startswith("vd")
        out["disk_kind"] = ("virtio block device (VM), " if virtio else "") + (
            "reported rotational" if out.get("rotational") else "non-rotational"
        )
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        pass
    return out


# --- numbers ---------------------------------------------------------------------------------------


STATISTICS = ("min", "median")


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def pick(results: dict, values: list[float]) -> float | None:
    """The statistic the tables use: ``min`` by default (on a shared machine the other samples
    measure the neighbours as much as the merge; timeit makes the same choice), or ``median``."""
    if not values:
        return None
    return min(values) if results["settings"].get("stat", "min") == "min" else statistics.median(values)


def _interp(results: dict, name: str) -> tuple[float | None, float | None]:
    entry = results["interpreters"].get(name)
    return (pick(results, entry["wall_s"]), pick(results, entry["peak_rss_bytes"])) if entry else (None, None)


def _ours_interpreter(results: dict) -> str:
    return OURS_INTERPRETER if OURS_INTERPRETER in results["interpreters"] else "torch+transformers"


def _series(results: dict, size: str, tool: str, dtype: str) -> dict | None:
    for s in results["runs"]:
        if (s["size"], s["tool"], s["dtype"]) == (size, tool, dtype) and s["wall_s"]:
            return s
    return None


def _backend(c: dict) -> str:
    return c.get("backend", "fsdp")


def _backends(results: dict) -> list[str]:
    return sorted({_backend(c) for c in results["checkpoints"]}, key=("fsdp", "megatron").index)


def _checkpoints(results: dict, backend: str | None = None) -> list[dict]:
    chosen = [c for c in results["checkpoints"] if backend is None or _backend(c) == backend]
    return sorted(
        chosen, key=lambda c: (("fsdp", "megatron").index(_backend(c)), c["parameters"] or 0, c["input_bytes"])
    )


def rows(results: dict) -> list[dict]:
    """One row per (checkpoint, tool, dtype) with every derived figure."""
    out = []
    torch_rss = _interp(results, "torch")[1]
    for c in _checkpoints(results):
        for tool in ("merge_pipeline", "verl"):
            for dtype in ("float32", "bfloat16", "float8_e4m3fn"):
                s = _series(results, c["size"], tool, dtype)
                if s is None:
                    continue
                raw = _series(results, c["size"], "raw", dtype)
                start_wall, interp_rss = _interp(
                    results, _ours_interpreter(results) if tool == "merge_pipeline" else "verl"
                )
                wall, rss, raw_s = (
                    pick(results, s["wall_s"]),
                    pick(results, s["peak_rss_bytes"]),
                    pick(results, raw["wall_s"]) if raw else None,
                )
                out.append(
                    {
                        "backend": _backend(c),
                        "size": c["size"],
                        "parameters": c["parameters"],
                        "input_bytes": c["input_bytes"],
                        "tool": tool,
                        "dtype": dtype,
                        "output_bytes": s["output_bytes"],
                        "wall_s": wall,
                        "wall_median_s": med(s["wall_s"]),
                        "raw_s": raw_s,
                        "cpu_s": pick(results, s.get("cpu_s", [])),
                        "startup_s": start_wall,
                        "input_gbps": c["input_bytes"] / wall / GB,
                        "wall_over_raw": wall / raw_s if raw_s else None,
                        "wall_over_raw_startup": wall / (raw_s + start_wall) if raw_s and start_wall else None,
                        "peak_rss": rss,
                        "rss_over_interp": rss - interp_rss if interp_rss else None,
                        "rss_over_torch": rss - torch_rss if torch_rss else None,
                        "flush_s": pick(results, s.get("flush_s", [])),
                    }
                )
    return out


def scaling(results: dict) -> list[dict]:
    """Smallest -> largest checkpoint of each backend: marginal time against the raw baseline's, RSS growth."""
    out = []
    for backend in _backends(results):
        cs = _checkpoints(results, backend)
        if len(cs) >= 2:
            out += _scaling(results, backend, cs[0], cs[-1])
    return out


def _scaling(results: dict, backend: str, small: dict, large: dict) -> list[dict]:
    out = []
    for tool in ("merge_pipeline", "verl"):
        for dtype in ("float32", "bfloat16"):
            a, b = _series(results, small["size"], tool, dtype), _series(results, large["size"], tool, dtype)
            ra, rb = _series(results, small["size"], "raw", dtype), _series(results, large["size"], "raw", dtype)
            if not (a and b and ra and rb):
                continue
            marginal = pick(results, b["wall_s"]) - pick(results, a["wall_s"])
            raw_marginal = pick(results, rb["wall_s"]) - pick(results, ra["wall_s"])
            out.append(
                {
                    "backend": backend,
                    "tool": tool,
                    "dtype": dtype,
                    "from": small["size"],
                    "to": large["size"],
                    "extra_bytes": large["input_bytes"] - small["input_bytes"],
                    "marginal_s": marginal,
                    "raw_marginal_s": raw_marginal,
                    "ratio": marginal / raw_marginal if raw_marginal > 0 else None,
                    "rss_growth": pick(results, b["peak_rss_bytes"]) - pick(results, a["peak_rss_bytes"]),
                }
            )
    return out


def targets(results: dict) -> list[tuple[str, bool | None, str]]:
    """(target, met?, figures); ``None`` when this run has no data for it."""
    table, scale = rows(results), scaling(results)
    ours = [r for r in table if r["tool"] == "merge_pipeline"]
    out: list[tuple[str, bool | None, str]] = []
    for s in (s for s in scale if s["tool"] == "merge_pipeline"):
        ok = s["ratio"] is not None and s["ratio"] <= MARGINAL_MAX
        out.append(
            (
                f"flat in size: marginal cost {s['from']}->{s['to']} within {MARGINAL_MAX}x of the raw baseline's ({_dt(s['dtype'])})",
                ok,
                f"{s['marginal_s']:.2f} s vs raw {s['raw_marginal_s']:.2f} s = {_fmt(s['ratio'], '.2f')}x",
            )
        )
        out.append(
            (
                f"flat in size: peak RSS growth {s['from']}->{s['to']} under 400 MB ({_dt(s['dtype'])})",
                s["rss_growth"] < RSS_GROWTH_MAX,
                f"{s['rss_growth'] / MB:+.0f} MB",
            )
        )
    if not scale:
        out.append(("flat in size: marginal cost and RSS growth", None, "needs at least two sizes"))
    for backend in _backends(results):
        largest = _checkpoints(results, backend)[-1]["size"]
        mine = next((r for r in ours if r["size"] == largest and r["dtype"] == "bfloat16"), None)
        theirs = next((r for r in table if r["tool"] == "verl" and r["size"] == largest), None)
        if mine and theirs:
            out.append(
                (
                    f"flat in size: {largest} fp32->bf16 wall time at most 1/3 of verl's",
                    mine["wall_s"] <= theirs["wall_s"] * VERL_WALL_FRACTION,
                    f"{mine['wall_s']:.2f} s vs verl {theirs['wall_s']:.2f} s = {mine['wall_s'] / theirs['wall_s']:.2f}x",
                )
            )
            out.append(
                (
                    f"flat in size: {largest} fp32->bf16 peak RSS at most 1/5 of verl's",
                    mine["peak_rss"] <= theirs["peak_rss"] * VERL_RSS_FRACTION,
                    f"{mine['peak_rss'] / MB:.0f} MB vs verl {theirs['peak_rss'] / MB:.0f} MB = {mine['peak_rss'] / theirs['peak_rss']:.2f}x",
                )
            )
        else:
            failed = next((f for f in results.get("failures", []) if f["size"] == largest), None)
            why = f"verl's merger failed: {failed['reason']}" if failed else "run with --with-verl"
            out.append((f"flat in size: {largest} fp32->bf16 against verl (1/3 wall, 1/5 RSS)", None, why))
    torch_start = _interp(results, "torch")[0]
    for backend in _backends(results):
        largest = _checkpoints(results, backend)[-1]["size"]
        lossless = next((r for r in ours if r["size"] == largest and r["dtype"] == "float32"), None)
        if lossless and lossless["raw_s"] is not None and torch_start:
            limit = LOSSLESS_OVER_COPY_MAX * (lossless["raw_s"] + torch_start)
            out.append(
                (
                    f"lossless: {largest} lossless fp32 wall within {LOSSLESS_OVER_COPY_MAX}x (raw copy + torch start-up)",
                    lossless["wall_s"] <= limit,
                    f"{lossless['wall_s']:.2f} s vs {LOSSLESS_OVER_COPY_MAX}x({lossless['raw_s']:.2f} + {torch_start:.2f}) = {limit:.2f} s",
                )
            )
    for r in (r for r in ours if r["dtype"] == "float8_e4m3fn"):
        bf16 = next((b for b in ours if b["size"] == r["size"] and b["dtype"] == "bfloat16"), None)
        if bf16:
            out.append(
                (
                    f"fp8: fp8 wall within {FP8_OVER_BF16_MAX}x of the bf16 merge's ({r['size']})",
                    r["wall_s"] <= FP8_OVER_BF16_MAX * bf16["wall_s"],
                    f"{r['wall_s']:.2f} s vs {bf16['wall_s']:.2f} s = {r['wall_s'] / bf16['wall_s']:.2f}x",
                )
            )
    for r in ours:
        out.append(
            (
                f"lossless: peak RSS at most 0.5 GB ({r['size']}, {_dt(r['dtype'])})",
                r["peak_rss"] <= PEAK_RSS_MAX,
                f"{r['peak_rss'] / MB:.0f} MB",
            )
        )
    for r in ours:
        if r["rss_over_torch"] is not None:
            out.append(
                (
                    f"248M: peak RSS within 0.5 GB of the torch interpreter ({r['size']}, {_dt(r['dtype'])})",
                    r["rss_over_torch"] <= RSS_OVER_TORCH_MAX,
                    f"{r['rss_over_torch'] / MB:+.0f} MB",
                )
            )
        if r["raw_s"] is not None and r["startup_s"] is not None:
            limit = WALL_OVER_IO_MAX * r["raw_s"] + r["startup_s"]
            out.append(
                (
                    f"248M: wall within 2x read+write plus start-up ({r['size']}, {_dt(r['dtype'])})",
                    r["wall_s"] <= limit,
                    f"{r['wall_s']:.2f} s vs 2x{r['raw_s']:.2f} + {r['startup_s']:.2f} = {limit:.2f} s",
                )
            )
    return out


# --- markdown --------------------------------------------------------------------------------------


def _dt(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}.get(dtype, dtype)


def _fmt(value, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value / scale, spec)


def render(results: dict) -> str:
    m, st = results["machine"], results["settings"]
    lines = []
    mem = f"{m['memory_bytes'] / 2**30:.0f} GiB RAM" if m.get("memory_bytes") else "RAM unknown"
    disk = f"{m.get('disk_device', '?')} ({m.get('filesystem', '?')}, {m.get('disk_kind', '?')})"
    commit = f" (commit {m['commit']})" if m.get("commit") else ""
    lines.append(
        f"Machine: {m['cpu']}, {m['cores']} cores, {mem}, disk {disk}, Linux {m['kernel']}, Python {m['python']}; "
        + ", ".join(f"{k} {v}" + (commit if k == "merge_pipeline" else "") for k, v in m["versions"].items() if v)
        + "."
    )
    lb, la = m.get("load_before"), m.get("load_after")
    if lb:
        lines.append(
            f"Load average (1/5/15 min) at start {lb[0]:.1f}/{lb[1]:.1f}/{lb[2]:.1f}"
            + (f", at end {la[0]:.1f}/{la[1]:.1f}/{la[2]:.1f}" if la else "")
            + "."
        )
    cache = {
        "cold": "evicted from the page cache (posix_fadvise DONTNEED)",
        "drop": "cold: `sync; echo 3 > /proc/sys/vm/drop_caches` (libraries too)",
    }.get(st["cache"], "read once into the page cache")
    nice = f"niceness {st['nice']}; " if st.get("nice") else ""
    statistic = "the fastest" if st.get("stat", "min") == "min" else "the median"
    lines.append(
        f"Settings: {st['repeat']} run(s) of everything, interleaved; figures are {statistic} of them (wall time also as the median); {nice}before each measurement the rank files were {cache}; "
        + (f"verl {st['verl_version']} side by side." if st.get("with_verl") else "no verl run.")
    )
    lines.append("")

    lines.append(
        "| size | params | input GB | tool | output | out GB | raw read+write s | wall s | wall s, median | CPU s | input GB/s | wall ÷ raw | wall ÷ (raw + start-up) | peak RSS MB | RSS − its interpreter MB | RSS − torch interpreter MB |"
    )
    lines.append("|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows(results):
        tool = "merge_pipeline" if r["tool"] == "merge_pipeline" else "verl"
        lines.append(
            f"| {r['size']} | {r['parameters'] / 1e6:.1f}M | {r['input_bytes'] / GB:.3f} | {tool} | {_dt(r['dtype'])} | {_fmt(r['output_bytes'], '.3f', GB)} "
            f"| {_fmt(r['raw_s'], '.2f')} | {r['wall_s']:.2f} | {r['wall_median_s']:.2f} | {_fmt(r['cpu_s'], '.2f')} | {r['input_gbps']:.3f} | {_fmt(r['wall_over_raw'], '.1f')} | {_fmt(r['wall_over_raw_startup'], '.2f')} "
            f"| {r['peak_rss'] / MB:.0f} | {_fmt(r['rss_over_interp'], '+.0f', MB)} | {_fmt(r['rss_over_torch'], '+.0f', MB) if r['tool'] == 'merge_pipeline' else '–'} |"
        )
    lines.append("")
    lines.append("Interpreters (children that import and exit; their wall time is the start-up cost):")
    lines.append("")
    lines.append("| interpreter | imports | wall s | CPU s | peak RSS MB |")
    lines.append("|---|---|---:|---:|---:|")
    for name, entry in results["interpreters"].items():
        code = entry["command"][-1]
        lines.append(
            f"| {name} | `{code}` | {pick(results, entry['wall_s']):.2f} | {_fmt(pick(results, entry.get('cpu_s', [])), '.2f')} | {pick(results, entry['peak_rss_bytes']) / MB:.0f} |"
        )
    runner = results.get("runner_peak_rss_bytes")
    if runner:
        lines.append("")
        lines.append(
            f"The benchmark runner's own peak RSS was {runner / MB:.0f} MB (a child's ru_maxrss cannot read below its parent's peak at spawn)."
        )
    flushes = [r for r in rows(results) if r["flush_s"] is not None]
    if flushes:
        lines.append("")
        lines.append(
            "verl does not fsync its output; the `sync` after it took (median, s): "
            + ", ".join(f"{r['size']} {r['flush_s']:.2f}" for r in flushes)
            + ". merge_pipeline's wall time includes its fsync."
        )
    scale = scaling(results)
    if scale:
        lines.append("")
        lines.append("Scaling, smallest to largest checkpoint:")
        lines.append("")
        lines.append(
            "| backend | tool | output | from → to | extra input GB | extra wall s | raw's extra s | ratio | peak RSS growth MB |"
        )
        lines.append("|---|---|---|---|---:|---:|---:|---:|---:|")
        for s in scale:
            lines.append(
                f"| {s['backend']} | {s['tool']} | {_dt(s['dtype'])} | {s['from']} → {s['to']} | {s['extra_bytes'] / GB:.3f} | {s['marginal_s']:.2f} | {s['raw_marginal_s']:.2f} | {_fmt(s['ratio'], '.2f')} | {s['rss_growth'] / MB:+.0f} |"
            )
    if results.get("failures"):
        lines.append("")
        lines.append("Runs that failed:")
        lines.append("")
        for f in results["failures"]:
            lines.append(f"- {f['size']}, {f['tool']}: exit {f['returncode']}: `{f['reason']}`")
    if results["comparisons"]:
        lines.append("")
        lines.append("Outputs compared (merge_pipeline vs verl, tensor by tensor, bytes):")
        lines.append("")
        for c in results["comparisons"]:
            lines.append(f"- {c['size']} ({_dt(c['dtype'])}): {c['summary']}")
    lines.append("")
    lines.append("Targets:")
    lines.append("")
    for name, ok, figures in targets(results):
        mark = "n/a" if ok is None else ("met" if ok else "**MISSED**")
        lines.append(f"- {mark}: {name}: {figures}")
    return "\n".join(lines) + "\n"


# --- plot ------------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(results)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        ("merge_pipeline", "float32"): ("C0", "o", "merge_pipeline fp32"),
        ("merge_pipeline", "bfloat16"): ("C1", "s", "merge_pipeline bf16"),
        ("verl", "bfloat16"): ("C3", "^", "verl bf16"),
    }
    for backend, line in (("fsdp", "-"), ("megatron", "--")):
        for (tool, dtype), (color, marker, label) in styles.items():
            pts = [r for r in table if (r["backend"], r["tool"], r["dtype"]) == (backend, tool, dtype)]
            if not pts:
                continue
            xs = [r["parameters"] / 1e6 for r in pts]
            name = label if backend == "fsdp" else f"{label} (Megatron)"
            ax_t.plot(xs, [r["wall_s"] for r in pts], color=color, marker=marker, linestyle=line, label=name)
            ax_m.plot(xs, [r["peak_rss"] / MB for r in pts], color=color, marker=marker, linestyle=line, label=name)
    startup = _interp(results, _ours_interpreter(results))[0] or 0.0
    for dtype, color in (("float32", "C0"), ("bfloat16", "C1")):
        pts = [
            r
            for r in table
            if (r["backend"], r["tool"], r["dtype"]) == ("fsdp", "merge_pipeline", dtype) and r["raw_s"] is not None
        ]
        if pts:
            xs = [r["parameters"] / 1e6 for r in pts]
            ax_t.plot(
                xs,
                [r["raw_s"] + startup for r in pts],
                color=color,
                linestyle=":",
                marker=".",
                label=f"raw read+write + start-up ({_dt(dtype)})",
            )
    for name, style in (("torch", "--"), (_ours_interpreter(results), "-."), ("verl", ":")):
        rss = _interp(results, name)[1]
        if rss:
            ax_m.axhline(rss / MB, color="grey", linestyle=style, linewidth=1, label=f"interpreter: {name}")
    ax_t.set(xlabel="parameters (millions)", ylabel="wall time (s)", title="Merge wall time (FSDP; Megatron TP 2)")
    ax_m.set(xlabel="parameters (millions)", ylabel="peak RSS (MB)", title="Merge peak RSS")
    ax_t.set_ylim(bottom=0)
    ax_m.set_ylim(bottom=0)
    for ax in (ax_t, ax_m):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- docs ------------------------------------------------------------------------------------------


def update_docs(results: dict, markdown: str, plot_path: Path | None) -> None:
    text = DOCS.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOCS}: markers {BEGIN!r} / {END!r} not found")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(f"{head}{BEGIN}\n\n{markdown}\n{END}{tail}")
    if plot_path is not None:
        DOCS_PLOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(plot_path, DOCS_PLOT)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    parser.add_argument("results", type=Path, help="a results.json written by python -m benchmarks.run")
    parser.add_argument("--stat", choices=("min", "median"), help="the statistic of the repeats shown")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="also draw the plot into this file")
    parser.add_argument("--update-docs", action="store_true", help="write the tables into docs/BENCHMARKS.md")
    args = parser.parse_args(argv)
    try:
        results = json.loads(args.results.read_text())
    except (OSError, ValueError) as exc:
        parser.exit(2, f"error: {args.results}: not a readable results.json ({exc})\n")
    if args.stat:
        results["settings"]["stat"] = args.stat
    markdown = render(results)
    print(markdown)
    if args.plot:
        plot(results, args.plot)
    if args.update_docs:
        update_docs(results, markdown, args.plot)


if __name__ == "__main__":
    main()
