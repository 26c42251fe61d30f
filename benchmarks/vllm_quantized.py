"""On a GPU host: vLLM loads each ``--quantize`` scheme's folder and generates a few tokens; prints a table.

    .venv/bin/python -m benchmarks.vllm_quantized --size large --out /tmp/vllm-quantized
    .venv/bin/python -m benchmarks.vllm_quantized --folders /tmp/vllm-quantized/W4A16 /tmp/other-folder

Without ``--folders`` it first merges the cached FSDP checkpoint of ``--size`` (``benchmarks/checkpoints.py``)
into ``OUT/bf16`` and ``OUT/<SCHEME>`` for each scheme (``merge --quantize``), then loads each folder. Every
load runs in a child process of its own (vLLM's GPU memory is given back when it exits), greedy, eager mode
(no CUDA graphs to capture); a folder that fails to load or generate is a row with the error's last line,
and the exit status is non-zero. vLLM is not a dependency of the project: install it on the GPU host.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.checkpoints import DEFAULT_CACHE, REPO_ROOT, SIZES, ensure_checkpoint
from merge_pipeline.hf.quantization import SCHEMES

PROMPT = "The capital of France is"
MERGE = [sys.executable, "-m", "merge_pipeline", "merge", "--no-progress"]


def merged_folders(size: str, schemes: list[str], out: Path, cache_dir: Path) -> list[Path]:
    """The bf16 merge and one quantized merge per scheme of the cached checkpoint (kept if already there)."""
    source = ["--local_dir", str(ensure_checkpoint(size, cache_dir).role_dir)]
    folders = []
    for name, flags in [("bf16", ["--dtype", "bfloat16"]), *((s, ["--quantize", s]) for s in schemes)]:
        folder = out / name
        if not (folder / "config.json").exists():
            subprocess.run([*MERGE, *source, "--target_dir", str(folder), *flags], check=True, cwd=REPO_ROOT)
        folders.append(folder)
    return folders


def generate_once(folder: Path, tokens: int) -> dict:
    """In this (child) process: load ``folder`` in vLLM, generate ``tokens`` greedy tokens of ``PROMPT``."""
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=str(folder), tokenizer=str(folder), enforce_eager=True, max_model_len=512, gpu_memory_utilization=0.4
    )
    loaded = time.perf_counter()
    [output] = llm.generate([PROMPT], SamplingParams(max_tokens=tokens, temperature=0.0))
    done = time.perf_counter()
    quant = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    return {
        "method": quant.get("quant_method", "none"),
        "load_s": loaded - start,
        "generate_s": done - loaded,
        "tokens": len(output.outputs[0].token_ids),
        "text": output.outputs[0].text,
    }


def run_child(folder: Path, tokens: int) -> dict:
    """``generate_once`` in a fresh process; its JSON result, or the error's last line."""
    child = [sys.executable, "-m", "benchmarks.vllm_quantized", "--one", str(folder), "--tokens", str(tokens)]
    done = subprocess.run(child, capture_output=True, text=True, cwd=REPO_ROOT)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    error = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {done.returncode}: {error}"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.vllm_quantized", description=__doc__.split("\n\n")[0])
    parser.add_argument("--folders", type=Path, nargs="+", help="merged folders to load (default: merge them first)")
    parser.add_argument(
        "--size", default="large", choices=sorted(SIZES), help="the checkpoint merged without --folders"
    )
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    parser.add_argument("--out", type=Path, default=Path("vllm-quantized"), help="where the merged folders go")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # the child: one folder, one JSON line
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(generate_once(args.one, args.tokens)))
        return
    folders = args.folders or merged_folders(args.size, args.schemes, args.out.resolve(), args.cache_dir)
    print("| folder | quant_method | load (s) | generate (s) | tokens | text or error |")
    print("|---|---|---|---|---|---|")
    failed = 0
    for folder in folders:
        result = run_child(folder.resolve(), args.tokens)
        if "error" in result:
            failed += 1
            print(f"| {folder.name} | | | | | {result['error']} |", flush=True)
        else:
            text = json.dumps(result["text"])
            print(
                f"| {folder.name} | {result['method']} | {result['load_s']:.1f} | {result['generate_s']:.2f}"
                f" | {result['tokens']} | {text} |",
                flush=True,
            )
    if failed:
        raise SystemExit(f"{failed} of {len(folders)} folders did not load or generate in vLLM")


if __name__ == "__main__":
    main()
