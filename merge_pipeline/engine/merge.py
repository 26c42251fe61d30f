"""The merge, start to end: plan -> validate -> stream weights -> assemble folder -> publish.

The stages are separate functions so the Dagster assets and the torchrun launcher can run them
one at a time; ``merge_checkpoint`` runs them all in one process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from merge_pipeline import __version__
from merge_pipeline.engine.hf_config import ModelConfig, load_model_config
from merge_pipeline.engine.hf_folder import copy_side_files, write_configs
from merge_pipeline.engine.lora import is_adapter_only, with_base_weights
from merge_pipeline.engine.manifest import write_manifest
from merge_pipeline.engine.outputs import MergeOptions, OutputLayout, ShardFile, plan_outputs
from merge_pipeline.engine.plan import CheckpointPlan
from merge_pipeline.engine.progress import ByteProgress, human_bytes
from merge_pipeline.engine.publish import check_target, staged_output
from merge_pipeline.engine.safetensors_writer import write_safetensors
from merge_pipeline.errors import naming
from merge_pipeline.formats import open_checkpoint

log = logging.getLogger("merge_pipeline")

INDEX = "model.safetensors.index.json"


@dataclass
class WriteReport:
    files: list[dict] = field(default_factory=list)  # filename, bytes, tensors, sha256
    seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(f["bytes"] for f in self.files)

    @property
    def tensors(self) -> int:
        return sum(f["tensors"] for f in self.files)


@dataclass
class MergeResult:
    target_dir: Path
    parameters: int
    tensors: int
    tensor_bytes: int  # bytes of tensor data written (file sizes add the headers)
    seconds: float
    peak_rss_bytes: int
    manifest: dict


def peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM); ru_maxrss would carry over the parent's peak across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def prepare(
    local_dir: str | Path, options: MergeOptions, backend: str = "auto"
) -> tuple[CheckpointPlan, ModelConfig, OutputLayout]:
    """Open and validate the checkpoint and decide every output file, reading no tensor data.

    ``backend``: the format named by the caller; "auto" leaves the choice to ``options.backend``.
    """
    plan = open_checkpoint(
        local_dir,
        options.backend if backend == "auto" else backend,
        verify_replicas=options.verify_replicas,
        is_value_model=options.is_value_model,
        tie_word_embedding=options.tie_word_embedding,
        trust_remote_code=options.trust_remote_code,
        hf_model_path=options.hf_model_path,
    )
    try:
        if options.hf_model_path and is_adapter_only(plan.tensors):
            plan = with_base_weights(plan, Path(options.hf_model_path))
        config = load_model_config(
            plan.hf_dir,
            trust_remote_code=options.trust_remote_code,
            role_dir=plan.role_dir,
            hf_model_path=options.hf_model_path,
        )
        layout = plan_outputs(plan, config, options)
        if plan.names_mapped:
            # Imported here: the module imports transformers (~1.3 s, ~35 MB), which FSDP never needs.
            from merge_pipeline.engine.architecture import (
                check_plan_against_architecture,
                expected_tensors,
                inert_absent_tensors,
            )

            # Names we mapped: key set and every shape against the architecture config.json
            # describes, so nothing is dropped silently and nothing the model needs is left out.
            # (FSDP names are the model's own keys; the check would cost seconds for nothing.)
            expected = expected_tensors(
                config.path.parent, value_model=layout.is_value_model, trust_remote_code=options.trust_remote_code
            )
            inert = inert_absent_tensors([t.planned for shard in layout.shards for t in shard.tensors], expected)
            if inert:  # e.g. a zero-width shared expert: written too, so from_pretrained misses nothing
                plan.tensors.extend(inert)
                layout = plan_outputs(plan, config, options)
            check_plan_against_architecture(
                [t.planned for shard in layout.shards for t in shard.tensors], expected, config.path
            )
    except BaseException:
        plan.close()
        raise
    return plan, config, layout


def write_weights(
    layout: OutputLayout, out_dir: Path, *, files: list[ShardFile] | None = None, show_progress: bool = True
) -> WriteReport:
    """Stream the weight files (all, or the given subset) into ``out_dir``."""
    files = layout.files if files is None else files
    progress = ByteProgress(sum(f.nbytes for f in files), "writing weights", enabled=show_progress)
    report = WriteReport()
    try:
        for shard in files:
            path = out_dir / shard.filename
            path.parent.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256()  # fed while the file is written: the manifest reads nothing back
            size = write_safetensors(path, shard.tensors, progress, digest=digest)
            report.files.append(
                {"filename": shard.filename, "bytes": size, "tensors": len(shard.tensors), "sha256": digest.hexdigest()}
            )
    finally:
        progress.close()
    report.seconds = time.monotonic() - progress.started
    return report


def write_index(layout: OutputLayout, out_dir: Path) -> None:
    if not layout.sharded:
        return
    weight_map = {t.planned.name: shard.filename for shard in layout.shards for t in shard.tensors}
    index = {"metadata": {"total_size": sum(s.nbytes for s in layout.shards)}, "weight_map": weight_map}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def finish_folder(
    plan: CheckpointPlan,
    config: ModelConfig,
    layout: OutputLayout,
    out_dir: Path,
    options: MergeOptions,
    written: WriteReport | None = None,
) -> dict:
    """Index, configs and manifest: everything but the weights and the side files.

    ``written``: the report of the weights written into ``out_dir``, whose sha256 the manifest reuses.
    """
    with naming(out_dir):
        write_index(layout, out_dir)
        write_configs(config, layout, out_dir)
        known = {f["filename"]: f["sha256"] for f in written.files if "sha256" in f} if written else None
        return write_manifest(out_dir, manifest_body(plan, layout, options), known)


def manifest_body(plan: CheckpointPlan, layout: OutputLayout, options: MergeOptions) -> dict:
    return {
        "tool": {"name": "merge_pipeline", "version": __version__},
        "source": {
            "backend": plan.backend,
            "role_dir": str(plan.role_dir),
            "role": plan.role,
            "layout": plan.layout,
            "inputs": [{"path": str(f.path), "size": f.size} for f in plan.files],
        },
        "options": asdict(options),
        "decisions": {
            "config_dtype": str(layout.config_dtype).removeprefix("torch."),
            "tensor_dtypes": _dtype_decisions(layout),
            "tied_word_embeddings": layout.tied,
            "dropped_tensors": layout.dropped,
            "value_model": layout.is_value_model,
            "lora": {
                "r": layout.lora.r,
                "lora_alpha": layout.lora.lora_alpha,
                "merged": options.merge_lora,
                "target_modules": layout.lora_targets,
            }
            if layout.lora
            else None,
        },
        "parameters": plan.parameter_count,
        "tensors": sum(len(f.tensors) for f in layout.files),
    }


def _dtype_decisions(layout: OutputLayout) -> dict[str, int]:
    """Counts of ``source -> output`` dtype pairs, so a lossy cast is visible in the manifest."""
    counts: dict[str, int] = {}
    for f in layout.files:
        for t in f.tensors:
            key = f"{str(t.planned.dtype).removeprefix('torch.')} -> {str(t.dtype).removeprefix('torch.')}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def merge_checkpoint(
    local_dir: str | Path,
    target_dir: str | Path,
    options: MergeOptions | None = None,
    *,
    backend: str = "auto",
    show_progress: bool = True,
) -> MergeResult:
    started = time.monotonic()
    options = options or MergeOptions()
    target = Path(target_dir).absolute()
    check_target(target, source=local_dir, overwrite=options.overwrite)
    plan, config, layout = prepare(local_dir, options, backend)
    with plan, staged_output(target, source=local_dir, overwrite=options.overwrite) as staging:
        copy_side_files(config.path.parent, staging, options.max_side_file_size, confine_to=config.confine_to)
        report = write_weights(layout, staging, show_progress=show_progress)
        manifest = finish_folder(plan, config, layout, staging, options, report)
    seconds = time.monotonic() - started
    log.info(
        "merged %s -> %s: %d tensors, %s in %.1f s",
        plan.role_dir,
        target,
        report.tensors,
        human_bytes(report.bytes),
        seconds,
    )
    return MergeResult(
        target, plan.parameter_count, report.tensors, layout.total_bytes, seconds, peak_rss_bytes(), manifest
    )
