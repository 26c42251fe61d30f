"""The pipelined writer (reader thread, writer, hasher thread) writes exactly the bytes of the plain
sequential path, hashes them on the way, and a merge imports nothing its path does not need."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from merge_pipeline.engine import safetensors_writer
from merge_pipeline.engine.safetensors_writer import OutputTensor, build_header, write_safetensors
from merge_pipeline.formats import coalesced_reads
from merge_pipeline.hf.manifest import MANIFEST, sha256_file, write_manifest
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.plan import Computed, PlannedTensor
from merge_pipeline.workers.writing import write_weights
from merge_pipeline_samples.fsdp import FsdpSpec

REPO_ROOT = Path(__file__).resolve().parents[2]


def sequential_bytes(tensors: list[OutputTensor]) -> bytes:
    """The plain path: the header, then each whole tensor in its output dtype, one after another."""
    return build_header(tensors) + b"".join(
        t.planned.load().to(t.dtype).reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors
    )


@pytest.mark.parametrize("grouped", [False, True], ids=["piece_by_piece", "grouped"])
@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_pipelined_output_and_digest_equal_the_sequential_path(fsdp_checkpoint, tmp_path, monkeypatch, dtype, grouped):
    # Chunks of 4 KiB: every tensor spans many chunks and the reader's buffers are reused many
    # times over, so a buffer refilled before it was written and hashed would show in the bytes.
    monkeypatch.setattr(safetensors_writer, "_CHUNK_BYTES", 4096)
    if not grouped:  # the sample's pieces are small: FSDP reads them a group at a time unless told otherwise
        monkeypatch.setattr(coalesced_reads, "SMALL_PIECE_BYTES", 0)
    sample = fsdp_checkpoint(FsdpSpec())
    plan, _, layout = prepare(sample.role_dir, MergeOptions(dtype=dtype))
    with plan:
        (shard,) = layout.files
        from_files = [t for t in shard.tensors if t.planned.source.byte_runs()]  # kernel copies (auto) or reads to cast
        assert from_files if not grouped else len(from_files) < len(shard.tensors)
        expected = sequential_bytes(shard.tensors)
        digest = hashlib.sha256()
        size = write_safetensors(tmp_path / "model.safetensors", shard.tensors, digest=digest)
    written = (tmp_path / "model.safetensors").read_bytes()
    assert size == len(written) == len(expected)
    assert written == expected
    assert digest.hexdigest() == hashlib.sha256(expected).hexdigest()


def test_built_tensors_are_written_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_writer, "_CHUNK_BYTES", 64)
    g = torch.Generator().manual_seed(1)
    values = {
        "a": torch.randn(37, 11, generator=g),
        "b": torch.randn(5, generator=g).to(torch.float16),
        "c": torch.randn(300, generator=g),
    }
    tensors = [
        OutputTensor(PlannedTensor(n, tuple(t.shape), t.dtype, Computed(lambda t=t: t.clone())), t.dtype)
        for n, t in values.items()
    ]
    tensors.append(
        OutputTensor(PlannedTensor("d", (300,), torch.float32, Computed(lambda: values["c"].clone())), torch.bfloat16)
    )
    digest = hashlib.sha256()
    write_safetensors(tmp_path / "x.safetensors", tensors, digest=digest)
    assert (tmp_path / "x.safetensors").read_bytes() == sequential_bytes(tensors)
    assert digest.hexdigest() == sha256_file(tmp_path / "x.safetensors")


def test_manifest_takes_digests_computed_while_writing(fsdp_checkpoint, tmp_path):
    sample = fsdp_checkpoint(FsdpSpec())
    plan, _, layout = prepare(sample.role_dir, MergeOptions())
    with plan:
        report = write_weights(layout, tmp_path, show_progress=False)
    (written,) = report.files
    assert written["sha256"] == sha256_file(tmp_path / written["filename"])
    (tmp_path / "config.json").write_text("{}")
    # A digest we pass in is recorded as given: the weights are not read a second time.
    manifest = write_manifest(tmp_path, {}, {written["filename"]: "0" * 64})
    assert manifest["files"][written["filename"]] == {"size": written["bytes"], "sha256": "0" * 64}
    assert manifest["files"]["config.json"]["sha256"] == hashlib.sha256(b"{}").hexdigest()
    assert json.loads((tmp_path / MANIFEST).read_text())["files"] == manifest["files"]


def test_plain_fsdp_merge_imports_no_dagster_or_http_client(fsdp_checkpoint, tmp_path):
    sample = fsdp_checkpoint(FsdpSpec())
    code = (
        "import json, sys\n"
        "from merge_pipeline.cli import main\n"
        f"rc = main(['merge', '--backend', 'fsdp', '--local_dir', {str(sample.role_dir)!r}, '--target_dir', {str(tmp_path / 'out')!r}, '--no-progress'])\n"
        "print(json.dumps([rc, sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'dagster', 'huggingface_hub', 'httpx', 'requests'))]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rc, imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert rc == 0 and (tmp_path / "out" / "model.safetensors").is_file()
    # The blocking checks import transformers in their own worker process (hf/check_worker.py), not in
    # the merging one; no Dagster, no HTTP stack.
    assert {m.split(".")[0] for m in imported} <= {"huggingface_hub"}
