"""A store target follows the rules of a folder target (``merge_pipeline/target_rules.py``), on the real S3
server of ``object_store.py``: a prefix equal to, inside or containing an input, or holding objects no merge
of ours wrote, is refused in one line before any work, with or without ``--overwrite``, every object of the
bucket left as it was; publishing deletes only what an earlier merge wrote; incomplete multipart uploads of
a killed merge are counted by ``inspect`` and aborted by the next merge into the target."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fsspec.asyn import sync

from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.merge import merge
from merge_pipeline.store.published_prefix import publish_folder
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli
from merge_pipeline_tests.object_store import upload

pytestmark = pytest.mark.slow


def bucket_state(fs, b: str) -> dict[str, str]:
    """Every object of the bucket by key, with the sha256 of its bytes."""
    return {key: hashlib.sha256(fs.cat_file(key)).hexdigest() for key in fs.find(b, refresh=True)}


def checkpoint_in_store(fs, b: str, fsdp_checkpoint) -> tuple[str, str]:
    """A verl run uploaded as a trainer's copy would: (the run prefix, its step's role folder)."""
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    run = sample.role_dir.parent.parent
    return upload(fs, run, f"{b}/run"), f"s3://{b}/run/{sample.role_dir.relative_to(run).as_posix()}"


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("case", ["run prefix above", "the input", "the input spelled //, /", "inside the input"])
def test_a_store_target_overlapping_the_input_is_refused_and_deletes_nothing(
    capsys, bucket, fsdp_checkpoint, tmp_path, monkeypatch, case, overwrite
):
    fs, b = bucket
    run, source = checkpoint_in_store(fs, b, fsdp_checkpoint)
    target, problem = {
        "run prefix above": (run, "contains the input checkpoint"),
        "the input": (source, "is the input checkpoint"),
        "the input spelled //, /": (source.replace("/run/", "//run/") + "/", "is the input checkpoint"),
        "inside the input": (f"{source}/merged", "lies inside the input checkpoint"),
    }[case]
    monkeypatch.setenv("MERGE_PIPELINE_SCRATCH", str(tmp_path / "scratch"))
    before = bucket_state(fs, b)

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", source, "--target_dir", target, "--no-progress",
        *(["--overwrite"] if overwrite else []),
    )  # fmt: skip

    assert code != 0 and error_lines(err) == [
        f"error: {target.rstrip('/')}: {problem} {source}: choose a --target_dir outside it"
    ], err
    assert bucket_state(fs, b) == before
    assert not (tmp_path / "scratch").exists()  # refused before any work


def test_a_store_target_that_is_the_hf_model_path_is_refused_and_deletes_nothing(
    capsys, bucket, fsdp_checkpoint, tmp_path, monkeypatch
):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    base = upload(fs, sample.reference_dir, f"{b}/base")  # the trainer's model.path: config and weights
    monkeypatch.setenv("MERGE_PIPELINE_SCRATCH", str(tmp_path / "scratch"))
    before = bucket_state(fs, b)

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", sample.role_dir, "--hf_model_path", base, "--target_dir", base,
        "--overwrite", "--no-progress",
    )  # fmt: skip

    assert code != 0 and error_lines(err) == [
        f"error: {base}: is the input checkpoint {base}: choose a --target_dir outside it"
    ], err
    assert bucket_state(fs, b) == before


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_a_prefix_holding_another_teams_objects_is_refused_and_deletes_nothing(
    capsys, bucket, fsdp_checkpoint, monkeypatch, tmp_path, overwrite
):
    fs, b = bucket
    _, source = checkpoint_in_store(fs, b, fsdp_checkpoint)
    fs.pipe(f"{b}/team/eval/results.json", b'{"accuracy": 0.9}')
    fs.pipe(f"{b}/team/notes.txt", b"another team's notes")
    monkeypatch.setenv("MERGE_PIPELINE_SCRATCH", str(tmp_path / "scratch"))
    before = bucket_state(fs, b)

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", source, "--target_dir", f"s3://{b}/team/", "--no-progress",
        *(["--overwrite"] if overwrite else []),
    )  # fmt: skip

    assert code != 0 and error_lines(err) == [
        f"error: s3://{b}/team: is not empty and has no merge_manifest.json from merge_pipeline: not replaced, "
        "even with --overwrite (move it away or choose another --target_dir)"
    ], err
    assert bucket_state(fs, b) == before


def test_our_output_with_objects_added_under_it_is_not_replaced_and_they_are_named(
    capsys, bucket, fsdp_checkpoint, monkeypatch, tmp_path
):
    fs, b = bucket
    _, source = checkpoint_in_store(fs, b, fsdp_checkpoint)
    monkeypatch.setenv("MERGE_PIPELINE_SCRATCH", str(tmp_path / "scratch"))
    assert run_cli(capsys, "merge", "--local_dir", source, "--target_dir", f"s3://{b}/merged", "--no-progress")[0] == 0
    fs.pipe(f"{b}/merged/eval/results.json", b"{}")
    before = bucket_state(fs, b)

    code, _, err = run_cli(
        capsys, "merge", "--local_dir", source, "--target_dir", f"s3://{b}/merged", "--overwrite", "--no-progress"
    )

    assert code != 0 and error_lines(err) == [
        f"error: s3://{b}/merged: holds 1 object(s) that no merge_manifest.json from merge_pipeline names "
        "(eval/results.json): not replaced, even with --overwrite (move them away or choose another --target_dir)"
    ], err
    assert bucket_state(fs, b) == before


def test_publishing_deletes_only_the_stale_files_an_earlier_merge_wrote(bucket, fsdp_checkpoint, tmp_path):
    """An object put under our output after the check (here: before publishing) is never ours to delete."""
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    url = f"s3://{b}/merged"
    merge(sample.role_dir, url, MergeOptions(max_shard_size=60_000), show_progress=False)
    old = {k.rsplit("/", 1)[-1] for k in fs.find(f"{b}/merged", refresh=True)}
    one_file = merge(sample.role_dir, tmp_path / "one", MergeOptions(), show_progress=False)
    fs.pipe(f"{b}/merged/eval/results.json", b"{}")

    publish_folder(one_file.target_dir, url, one_file.manifest)

    now = {k.removeprefix(f"{b}/merged/") for k in fs.find(f"{b}/merged", refresh=True)}
    assert now == {p.name for p in one_file.target_dir.iterdir()} | {"eval/results.json"}
    assert len(old - now) > 2  # the earlier shards and their index: deleted
    assert not fs.exists(f"{b}/merged.merge_publishing")


def test_average_into_a_store_target_that_is_one_of_its_inputs_is_refused_before_any_work(
    capsys, bucket, fsdp_checkpoint, monkeypatch, tmp_path
):
    fs, b = bucket
    urls = []
    for seed in (0, 1):
        merged = merge(
            fsdp_checkpoint(FsdpSpec(with_optimizer=False, seed=seed)).role_dir,
            tmp_path / f"step_{seed}",
            MergeOptions(),
            show_progress=False,
        ).target_dir
        urls.append(upload(fs, merged, f"{b}/merged/step_{seed}"))
    monkeypatch.setenv("MERGE_PIPELINE_SCRATCH", str(tmp_path / "scratch"))
    before = bucket_state(fs, b)

    code, _, err = run_cli(
        capsys, "average", "--inputs", *urls, "--target_dir", urls[1] + "/", "--overwrite", "--no-progress"
    )

    assert code != 0 and error_lines(err) == [
        f"error: {urls[1]}: is the input checkpoint {urls[1]}: choose a --target_dir outside it"
    ], err
    assert bucket_state(fs, b) == before
    assert not (tmp_path / "scratch").exists()


def uploads_under(fs, b: str, prefix: str) -> list[str]:
    found = sync(fs.loop, fs._call_s3, "list_multipart_uploads", Bucket=b, Prefix=prefix)
    return sorted(u["Key"] for u in found.get("Uploads") or [])


def test_a_merge_killed_mid_upload_leaves_multipart_uploads_that_inspect_counts_and_the_next_merge_aborts(
    bucket, fsdp_checkpoint, tmp_path
):
    fs, b = bucket
    # weight files of several 5 MiB parts (S3's smallest part, MERGE_PIPELINE_PART_BYTES' lower bound)
    sample = fsdp_checkpoint(FsdpSpec(world_size=3, hidden_size=512, intermediate_size=2048, vocab_size=8000))
    target = f"s3://{b}/model"
    # a neighbour whose name starts with the target's: its upload is not the target's to abort
    neighbour = sync(fs.loop, fs._call_s3, "create_multipart_upload", Bucket=b, Key="model-2/weights.safetensors")
    merge_command = [
        sys.executable, "-m", "merge_pipeline", "merge", "--local_dir", str(sample.role_dir),
        "--target_dir", target, "--max-shard-size", "12MB", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "MERGE_PIPELINE_SCRATCH": str(tmp_path / "scratch")}
    small_parts = {"MERGE_PIPELINE_PART_BYTES": "5MiB", "MERGE_PIPELINE_PARTS_IN_FLIGHT": "1"}
    killed = subprocess.Popen(merge_command, env={**env, **small_parts, "MERGE_PIPELINE_PARALLEL_UPLOADS": "1"})
    deadline = time.monotonic() + 120
    while not uploads_under(fs, b, "model/"):
        assert killed.poll() is None and time.monotonic() < deadline, "no multipart upload seen"
        time.sleep(0.005)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    left = uploads_under(fs, b, "model/")
    assert left

    inspected = subprocess.run(
        [sys.executable, "-m", "merge_pipeline", "inspect", target], env=env, capture_output=True, text=True
    )
    assert f"{target}: {len(left)} incomplete multipart upload(s) of " in inspected.stderr, inspected.stderr
    assert Path(left[0]).name in inspected.stderr

    resumed = subprocess.run(merge_command, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"{target}: aborted {len(left)} incomplete multipart upload(s) of " in resumed.stderr
    assert uploads_under(fs, b, "model/") == []
    assert uploads_under(fs, b, "model-2/") == ["model-2/weights.safetensors"]
    sync(fs.loop, fs._call_s3, "abort_multipart_upload", Bucket=b, Key=neighbour["Key"], UploadId=neighbour["UploadId"])
