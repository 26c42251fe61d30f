"""``merge-pipeline merge --hf_upload_path`` and ``merge-pipeline upload``, end to end, as a user runs them."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli, tree_digest
from merge_pipeline_tests.hub.conftest import TOKENS, WRITER, endless_endpoint, silent_endpoint


def test_merge_and_upload_with_a_stored_login(hub, fsdp_checkpoint, tmp_path):
    """Separate processes, and only what a user sets: HF_ENDPOINT and an `hf auth login`.

    No HF_HUB_DISABLE_XET: pointing at a private Hub must be enough.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf_home"), PYTHONWARNINGS="ignore")
    login = subprocess.run(
        [Path(sys.executable).parent / "hf", "auth", "login", "--token", WRITER],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert login.returncode == 0, login.stderr
    target = tmp_path / "merged"
    merge = [
        "merge", "--backend", "fsdp", "--local_dir", fsdp_checkpoint(FsdpSpec()).role_dir, "--target_dir", target, "--no-progress",
        "--hf_upload_path", "org/run-a", "--private", "--revision", "step-1", "--commit-message", "step 1 of run a",
    ]  # fmt: skip

    done = subprocess.run(
        [sys.executable, "-m", "merge_pipeline", *map(str, merge)], env=env, capture_output=True, text=True, timeout=300
    )

    assert done.returncode == 0, done.stderr
    repo = hub.repos[("model", "org/run-a")]
    files = len(list(target.iterdir())) + 1  # and the model card
    commit_url = f"{hub.endpoint}/org/run-a/commit/{repo.branches['step-1']}"
    assert (
        done.stdout.splitlines()[-1]
        == f"uploaded to {hub.endpoint}/org/run-a/tree/step-1: {files} of {files} files sent, all verified ({commit_url})"
    )
    assert repo.private and repo.resolve("step-1").message == "step 1 of run a"
    uploaded = {p: hashlib.sha256(data).hexdigest() for p, data in hub.tree("org/run-a", "step-1").items()}
    assert {p: d for p, d in uploaded.items() if p not in ("README.md", ".gitattributes")} == tree_digest(target)
    assert not [r for r in hub.requests if "xet" in r.path]  # plain LFS: the endpoint alone switched Xet off
    assert not [t for t in TOKENS if t in login.stdout + login.stderr + done.stdout + done.stderr]


def test_upload_retries_a_5xx_and_debug_logs_show_no_token(hub, merged_folder, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    hub.fail("POST", "/commit/main$", status=500)

    code, out, err = run_cli(capsys, "-v", "upload", merged_folder, "org/run-b")

    assert code == 0, err
    assert (
        "hub: attempt 1 of 4 failed (HTTP 500 on POST /api/models/org/run-b/commit/main); retrying in 2 s"
        in caplog.text
    )
    assert out.startswith(f"uploaded to {hub.endpoint}/org/run-b: 11 of 11 files sent, all verified")
    assert not [t for t in TOKENS if t in out + err + caplog.text]


def test_upload_errors_are_one_line(hub, merged_folder, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_revoked")

    code, _, err = run_cli(capsys, "upload", merged_folder, "org/run-c")

    assert code == 1
    assert (
        error_lines(err)
        == err.splitlines()
        == [
            f"error: {hub.endpoint} rejected the token (401 Unauthorized): set HF_TOKEN to a valid token or run `hf auth login`"
        ]
    )


def upload_process(*argv, **env) -> subprocess.CompletedProcess:
    """`merge-pipeline upload` as a user runs it: its own process, real stderr, logging as the CLI sets it up."""
    command = [sys.executable, "-m", "merge_pipeline", "upload", *map(str, argv)]
    return subprocess.run(
        command, env={**os.environ, "PYTHONWARNINGS": "ignore", **env}, capture_output=True, text=True, timeout=120
    )


def test_a_failed_upload_prints_one_line_and_none_of_the_http_clients(hub, merged_folder):
    done = upload_process(merged_folder, "org/run-d", HF_TOKEN="hf_revoked" + WRITER)

    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"error: {hub.endpoint} rejected the token (401 Unauthorized): set HF_TOKEN to a valid token or run `hf auth login`"
    ]
    assert done.stdout == ""


UPLOAD_AND_PEAK = """
import sys
from merge_pipeline.cli import main
from merge_pipeline.workers.writing import peak_rss_bytes
code = main(sys.argv[1:])
print(f"peak {peak_rss_bytes()}")
sys.exit(code)
"""


def test_a_hub_answering_without_end_costs_bounded_memory_and_one_line(hub, merged_folder):
    """Every answer is capped (64 MB): the upload fails in one line instead of growing without bound (16.5 GB in 90 s)."""
    with endless_endpoint() as endpoint:
        done = subprocess.run(
            [sys.executable, "-c", UPLOAD_AND_PEAK, "upload", str(merged_folder), "org/run-f"],
            env={**os.environ, "PYTHONWARNINGS": "ignore", "HF_ENDPOINT": endpoint},
            capture_output=True,
            text=True,
            timeout=20,  # a regression fails here, before it eats the machine's memory
        )

    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines() == [
        "error: the Hub's answer to POST /api/repos/create passed 64 MB: not a Hub answer, refused"
    ]
    assert int(done.stdout.split()[-1]) < 700 << 20, done.stdout


def test_a_hub_that_never_answers_fails_in_bounded_time_with_one_line(hub, merged_folder):
    """--hub-timeout 1 and the default retries (4 attempts, 2 + 4 + 8 s apart): about 18 s, not forever."""
    with silent_endpoint() as endpoint:
        started = time.monotonic()
        done = upload_process(merged_folder, "org/run-e", "--hub-timeout", 1, HF_ENDPOINT=endpoint)
        elapsed = time.monotonic() - started

    assert done.returncode == 1 and elapsed < 4 * 1 + 14 + 25  # timeouts + waits + slack for a loaded machine
    *retries, error = done.stderr.splitlines()
    assert error == (
        f"error: org/run-e: cannot reach {endpoint} (ReadTimeout: timed out on POST /api/repos/create): "
        f"resume with `merge-pipeline upload {merged_folder} org/run-e` (files already on the Hub are not sent again)"
    )
    assert len(retries) == 3 and all(
        re.fullmatch(
            r"hub: attempt \d of 4 failed \(ReadTimeout: timed out on POST /api/repos/create\); retrying in \d s", line
        )
        for line in retries
    )
    assert not [t for t in TOKENS if t in done.stdout + done.stderr]


def edit(manifest: dict, variant: str):
    """The manifest as a user might have edited it (or another tool written it)."""
    if variant == "not_json":
        return "{edited"
    if variant == "a_list":
        return [manifest]
    if variant == "no_source":
        return {k: v for k, v in manifest.items() if k != "source"}
    if variant == "files_a_list":
        return {**manifest, "files": list(manifest["files"])}
    if variant == "entry_without_sha256":
        name = next(iter(manifest["files"]))
        return {**manifest, "files": {**manifest["files"], name: {"size": 1}}}
    if variant == "role_dir_a_number":
        return {**manifest, "source": {**manifest["source"], "role_dir": 7}}
    return {k: v for k, v in manifest.items() if k != "decisions"}  # no_decisions


@pytest.mark.parametrize(
    "variant",
    ["not_json", "a_list", "no_source", "files_a_list", "entry_without_sha256", "role_dir_a_number", "no_decisions"],
)
def test_uploading_an_edited_manifest_is_one_line(capsys, hub, merged_folder, tmp_path, variant):
    folder = tmp_path / "edited"
    shutil.copytree(merged_folder, folder)
    manifest = json.loads((folder / "merge_manifest.json").read_text())
    edited = edit(manifest, variant)
    (folder / "merge_manifest.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))

    code, out, err = run_cli(capsys, "upload", folder, "org/run-g")

    assert code == 1 and out == ""
    [line] = err.splitlines()
    assert line.startswith(f"error: {folder / 'merge_manifest.json'}: "), line
    assert not hub.sent("POST", "/api/repos/create")


@pytest.mark.parametrize(
    ("flags", "env", "problem"),
    [
        (["--revision", ".."], {}, "--revision '..': not a branch name the Hub accepts (git's rules)"),
        (["--revision", "a/../main"], {}, "--revision 'a/../main': not a branch name the Hub accepts (git's rules)"),
        (
            [],
            {"MERGE_PIPELINE_HUB_TIMEOUT": "soon"},
            "MERGE_PIPELINE_HUB_TIMEOUT is 'soon': expected a finite number of seconds > 0 and <= 86400",
        ),
    ],
    ids=["dot_dot", "dot_dot_inside", "timeout_env"],
)
def test_hub_settings_are_refused_before_the_merge(
    capsys, hub, fsdp_checkpoint, tmp_path, monkeypatch, flags, env, problem
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    target = tmp_path / "merged"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", fsdp_checkpoint(FsdpSpec()).role_dir, "--target_dir", target,
        "--no-progress", "--hf_upload_path", "org/run-h", *flags,
    )  # fmt: skip

    assert code == 1
    assert error_lines(err) == [f"error: {problem}"]
    assert not target.exists(), "refused before merging, not after publishing"
    assert not hub.sent("POST", "/api/repos/create")
