"""What each stage of the merge step shows in the UI: ``parallel_config``, ``state_dict`` and ``hf_model``.

The three are materialized together by ``hf_model``'s one step (``assets.merge_step``), after the
folder was published, so each describes a part of the published folder, never staging data:
``parallel_config`` what the checkpoint is and what the plan decided, ``state_dict`` the weight
files, ``hf_model`` the complete folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from merge_pipeline.dagster.metadata import sha256_table, value
from merge_pipeline.hf.file_names import INDEX
from merge_pipeline.options import MergeOptions
from merge_pipeline.progress import human_bytes
from merge_pipeline.store.record import MANIFEST

if TYPE_CHECKING:  # the workers' types import torch: a run does, the code location's load does not
    from merge_pipeline.workers.writing import Prepared, WriteReport


def parallel_config_metadata(prepared: Prepared, options: MergeOptions, manifest: Mapping) -> dict:
    """``inspect``'s facts (the same function builds both) and the plan's decisions, as the manifest records them."""
    from merge_pipeline.pipeline.inspect import checkpoint_facts

    decisions = manifest["decisions"]
    facts = checkpoint_facts(prepared.plan, options, prepared.config, decisions)
    inputs = facts.pop("files")
    return {
        **{k: value(v) for k, v in facts.items()},
        "input files": len(inputs),
        "input bytes": sum(f["size"] for f in inputs),
        "dtype": decisions["config_dtype"],  # what config.json says and the weights hold, after `dtype`
        "tensor dtypes": dg.MetadataValue.json(decisions["tensor_dtypes"]),
        "requested dtype": options.dtype,
        **({"fp8": dg.MetadataValue.json(decisions["fp8"])} if "fp8" in decisions else {}),
        "shards": len(prepared.outputs.files),
        "max shard size": str(options.max_shard_size),
        "tied (written)": value(decisions["tied_word_embeddings"]),
        "dropped tensors": value(decisions["dropped_tensors"]),
        "lora handling": _lora_handling(decisions["lora"]),
    }


def _lora_handling(lora: Mapping | None) -> str:
    if lora is None:
        return "no LoRA tensors"
    how = "folded into the weights" if lora["merged"] else "written as lora_adapter/ (not folded)"
    return f"r={lora['r']}, alpha={lora['lora_alpha']}: {how}"


def state_dict_metadata(target: Path, report: WriteReport, manifest: Mapping, rss: tuple[str, int]) -> dict:
    """The weight files of the published folder: names, full sha256, sizes, the write's throughput."""
    weights = {f["filename"] for f in report.files}
    label, peak = rss
    return {
        "path": dg.MetadataValue.path(str(target)),
        "index": dg.MetadataValue.path(str(target / INDEX)) if (target / INDEX).is_file() else "none (one file)",
        "weight files": len(weights),
        "tensors": report.tensors,
        "size": human_bytes(report.bytes),
        "bytes": report.bytes,
        "weights seconds": round(report.seconds, 3),
        "throughput": f"{human_bytes(report.written_bytes / max(report.seconds, 1e-9))}/s",  # kept files: no time
        label: human_bytes(peak),  # whose peak: the process's, the largest rank's or Ray task's
        "files": sha256_table({n: f for n, f in manifest["files"].items() if n in weights}),
    }


def hf_model_metadata(target: Path, prepared: Prepared, manifest: Mapping) -> dict:
    """The complete published folder: config, tokenizer and other side files, the manifest of every file."""
    weights_and_index = {n for n in manifest["files"] if n.endswith(".safetensors") or n == INDEX}
    return {
        "path": dg.MetadataValue.path(str(target)),
        "architecture": prepared.config.architecture,
        "parameters": manifest["parameters"],
        "dtype": manifest["decisions"]["config_dtype"],
        "config": dg.MetadataValue.path(str(target / "config.json")),
        "side files": value(sorted(n for n in manifest["files"] if n not in weights_and_index)),
        "manifest": dg.MetadataValue.path(str(target / MANIFEST)),
        "files": sha256_table(manifest["files"]),
        "options": dg.MetadataValue.json(json.loads(json.dumps(manifest["options"]))),
    }
