"""What the workers are handed and what they write: the lead's plan (``Prepared``), a worker's job
(``WeightJob``), its share of the weight files (``write_share``) and the report the lead gathers.

Below ``pipeline`` and every launcher: the lead's sequence (``pipeline.merge``) and each worker, in the
lead's process or another, write weight files with the same code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from merge_pipeline import __version__
from merge_pipeline.engine.outputs import OutputPlan, ShardFile
from merge_pipeline.engine.quantize import quantizing_pass
from merge_pipeline.engine.resume import RECORDS, ResumeLog, merge_key, seal
from merge_pipeline.engine.safetensors_writer import build_header, write_safetensors
from merge_pipeline.hf.config import ModelConfig
from merge_pipeline.hf.manifest import stat_identity
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import CheckpointPlan
from merge_pipeline.progress import ByteProgress
from merge_pipeline.store.lock import LockGuard
from merge_pipeline.store.published_prefix import UploadSink, unguarded
from merge_pipeline.store.url import as_location


@dataclass
class WriteReport:
    # filename, bytes, tensors, sha256 (computed while written, or by the resume's check of a kept file)
    # and identity (the file's stat identity then: the blocking checks trust the sha256 while it holds)
    files: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def by_file(self) -> dict[str, dict]:
        return {f["filename"]: f for f in self.files}

    @property
    def bytes(self) -> int:
        return sum(f["bytes"] for f in self.files)

    @property
    def tensors(self) -> int:
        return sum(f["tensors"] for f in self.files)

    @property
    def written_bytes(self) -> int:
        """The bytes this merge wrote: a resumed merge's kept files (``kept``) took none of its seconds."""
        return sum(f["bytes"] for f in self.files if not f.get("kept"))


class Prepared(NamedTuple):
    """A validated plan, built once and handed on: the input (open files), its config, the output files."""

    plan: CheckpointPlan
    config: ModelConfig
    outputs: OutputPlan

    def __enter__(self) -> Prepared:
        return self

    def __exit__(self, *exc: object) -> None:
        self.plan.close()


@dataclass(frozen=True)
class WeightJob:
    """What a worker needs to write its share of the weights: it opens and plans ``local_dir`` itself
    (metadata only) when it runs in another process, and reuses what the lead kept in ``staging``."""

    local_dir: str | Path  # a path, or a store URL (each worker reads it through its own view)
    staging: Path  # beside the target: the shards are renamed into place with the rest of the folder
    options: MergeOptions
    # The weight files a killed merge finished, as the lead checked them (file name -> write report entry):
    # handed to every worker, never re-read from the records in the staging folder, which anyone able to
    # write there could edit meanwhile.
    kept: Mapping[str, Mapping] = field(default_factory=dict)
    # A target in a store: each weight file is uploaded there as soon as it is written (``storage.UploadSink``).
    upload_to: str | None = None
    # The token of the lead's lock on ``upload_to``: every worker confirms it before each upload (``LockGuard``).
    lock_token: str | None = None

    def guard(self) -> Callable[[], None]:
        return LockGuard(self.upload_to, self.lock_token) if self.upload_to and self.lock_token else unguarded

    def saved(self) -> Path:
        """The job as JSON beside the resume records, for workers started as other processes (on every node
        that sees the staging folder); removed with the records before the folder is finished."""
        path = self.staging / RECORDS / "job.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({**asdict(self), "local_dir": str(self.local_dir), "staging": str(self.staging)}))
        return path

    @classmethod
    def load(cls, path: Path) -> WeightJob:
        job = json.loads(path.read_text())
        local_dir = as_location(job["local_dir"])
        options = MergeOptions(**job["options"])
        return cls(local_dir, Path(job["staging"]), options, job["kept"], job["upload_to"], job["lock_token"])

    def planned_as(self, prepared: Prepared) -> WeightJob:
        """For workers in other processes: the backend the lead's plan found, so they do not detect it again.
        An average keeps its options: each input's backend is its own (the plan's is ``average``)."""
        if self.options.average_inputs:
            return self
        return replace(self, options=replace(self.options, backend=prepared.plan.backend))


@dataclass(frozen=True)
class Written:
    """The weights of the whole output as the lead learns them: the write report, and whose peak RSS."""

    report: WriteReport
    peak_rss_bytes: int
    peak_rss_label: str  # the lead's whole process (imports included), or the largest of several workers


def peak_rss_bytes() -> int:
    """This process's own peak RSS (VmHWM); ru_maxrss would carry over the parent's peak across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_weights(
    outputs: OutputPlan,
    out_dir: Path,
    *,
    files: list[ShardFile] | None = None,
    show_progress: bool = True,
    resume: ResumeLog | None = None,
    sink: UploadSink | None = None,
) -> WriteReport:
    """Stream the weight files (all, or the given subset) into ``out_dir``; with ``resume``, keep the
    files it lists as finished and record each newly finished one; with ``sink``, upload each once written."""
    files = outputs.files if files is None else files
    reused = {shard.filename for shard in files if resume and shard.filename in resume.finished}
    description = "writing weights"
    if reused:
        description += f" ({len(reused)} of {len(files)} files reused from a killed merge)"
    # the files' sizes, headers included: what the writer counts, so the progress ends at 100% of its total
    total = sum(len(build_header(f.tensors)) + f.nbytes for f in files)
    kept = sum(resume.finished[name]["bytes"] for name in reused)  # whole files, as the total counts them
    progress = ByteProgress(total, description, done=kept, enabled=show_progress)
    report = WriteReport()
    try:
        # a quantizing pass: torch on one intra-op thread, the bands quantized on workers (engine.quantize)
        with quantizing_pass() if outputs.quantization else contextlib.nullcontext():
            for shard in files:
                if shard.filename in reused:
                    report.files.append({**resume.finished[shard.filename], "kept": True})
                    continue
                path = out_dir / shard.filename
                path.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()  # fed while the file is written: the manifest reads nothing back
                size = write_safetensors(path, shard.tensors, progress, digest=digest)
                seal(path, digest.hexdigest())  # before the identity: a resume trusts the digest only with both
                entry = {
                    "filename": shard.filename,
                    "bytes": size,
                    "tensors": len(shard.tensors),
                    "sha256": digest.hexdigest(),
                    "identity": stat_identity(os.stat(path)),  # right after the fsync
                }
                report.files.append(entry)
                if resume:
                    resume.record(entry)
                if sink:
                    sink.add(out_dir, shard.filename, entry["sha256"])
        if sink:
            sink.close()
            for entry in report.files:  # a hole was punched in each: the checks trust its sha256 as it is now
                entry["identity"] = stat_identity(os.stat(out_dir / entry["filename"]))
    finally:
        progress.close()
    report.seconds = time.monotonic() - progress.started
    return report


def gathered(files: list[ShardFile], reports: list[WriteReport]) -> WriteReport:
    """Workers' reports as one: every file's entry in plan order (``files``), the time of the slowest worker."""
    by_name = {f["filename"]: f for report in reports for f in report.files}
    return WriteReport([by_name[f.filename] for f in files], max(r.seconds for r in reports))


def resume_key(prepared: Prepared, options: MergeOptions) -> str:
    # With the backend the plan found: a launcher hands its workers the detected one, and `auto` or the
    # name of what it detects write the same bytes.
    described = {"version": __version__, **asdict(options), "backend": prepared.plan.backend}
    return merge_key(prepared.plan.files, described, prepared.outputs.files)


def write_share(job: WeightJob, prepared: Prepared, files: list[ShardFile], *, show_progress: bool) -> WriteReport:
    """A worker's part of the weights: ``files``, reusing those the lead's ``resume_killed`` kept."""
    resume = ResumeLog(job.staging, resume_key(prepared, job.options), dict(job.kept))
    sink = UploadSink(job.upload_to, job.guard()) if job.upload_to else None
    try:
        return write_weights(
            prepared.outputs, job.staging, files=files, show_progress=show_progress, resume=resume, sink=sink
        )
    finally:
        if sink:
            sink.pool.shutdown(cancel_futures=True)


def assign_shards(files: list[ShardFile], world_size: int) -> list[list[ShardFile]]:
    """Balance bytes: biggest file first to the least-loaded worker (deterministic on every worker)."""
    loads = [0] * world_size
    assigned: list[list[ShardFile]] = [[] for _ in range(world_size)]
    for f in sorted(files, key=lambda f: (-f.nbytes, f.filename)):
        worker = min(range(world_size), key=lambda w: (loads[w], w))
        assigned[worker].append(f)
        loads[worker] += f.nbytes
    return assigned
