"""``merge-pipeline merge --hf_upload_path`` and ``merge-pipeline upload``, end to end, as a user runs them."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

from merge_pipeline.sample_checkpoints.fsdp import FsdpSpec
from merge_pipeline_tests.helpers import error_lines, run_cli, tree_digest
from merge_pipeline_tests.hub.conftest import TOKENS, WRITER


def test_merge_and_upload_with_a_stored_login(hub, fsdp_checkpoint, tmp_path):
    """Separate processes, and only what a user sets: HF_ENDPOINT and an `hf auth login`.

    No HF_HUB_DISABLE_XET: pointing at a private Hub must be enough.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGING_FACE_"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf_home"), PYTHONWARNINGS="ignore")
    login = subprocess.run([Path(sys.executable).parent / "hf", "auth", "login", "--token", WRITER], env=env, capture_output=True, text=True, timeout=120)
    assert login.returncode == 0, login.stderr
    target = tmp_path / "merged"
    merge = [
        "merge", "--backend", "fsdp", "--local_dir", fsdp_checkpoint(FsdpSpec()).role_dir, "--target_dir", target, "--no-progress",
        "--hf_upload_path", "org/run-a", "--private", "--revision", "step-1", "--commit-message", "step 1 of run a",
    ]  # fmt: skip

    done = subprocess.run([sys.executable, "-m", "merge_pipeline", *map(str, merge)], env=env, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr
    repo = hub.repos[("model", "org/run-a")]
    files = len(list(target.iterdir())) + 1  # and the model card
    commit_url = f"{hub.endpoint}/org/run-a/commit/{repo.branches['step-1']}"
    assert done.stdout.splitlines()[-1] == f"uploaded to {hub.endpoint}/org/run-a/tree/step-1: {files} of {files} files sent, all verified ({commit_url})"
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
    assert "hub: attempt 1 of 4 failed (HTTP 500 on POST /api/models/org/run-b/commit/main); retrying in 2 s" in caplog.text
    assert out.startswith(f"uploaded to {hub.endpoint}/org/run-b: 11 of 11 files sent, all verified")
    assert not [t for t in TOKENS if t in out + err + caplog.text]


def test_upload_errors_are_one_line(hub, merged_folder, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_revoked")

    code, _, err = run_cli(capsys, "upload", merged_folder, "org/run-c")

    assert code == 1
    assert error_lines(err) == err.splitlines() == [f"error: {hub.endpoint} rejected the token (401 Unauthorized): set HF_TOKEN to a valid token or run `hf auth login`"]
