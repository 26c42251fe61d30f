"""Uploads with the real huggingface_hub client to a Hub-compatible server, and what the user sees."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import time
import traceback

import pytest
from huggingface_hub import snapshot_download
from huggingface_hub.errors import RepositoryNotFoundError

from merge_pipeline import __version__
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.manifest import MANIFEST, read_manifest
from merge_pipeline.hub.model_card import CARD_END, CARD_START
from merge_pipeline.hub.upload import RetryPolicy, upload_folder_verified
from merge_pipeline_tests.helpers import tree_digest
from merge_pipeline_tests.hub.conftest import OUTSIDER, READER, TOKENS, WRITER, silent_endpoint

FAST = RetryPolicy(attempts=3, first_wait_s=0.01)


def upload(folder, repo_id="org/ppo-qwen", **kwargs):
    return upload_folder_verified(folder, repo_id, retry=FAST, **kwargs)


def lfs_puts(hub) -> list[str]:
    return [r.path.removeprefix("/lfs/") for r in hub.sent("PUT", "^/lfs/") if r.status == 200]


def test_round_trip_is_byte_identical_and_leaves_the_folder_alone(hub, merged_folder, tmp_path):
    before = tree_digest(merged_folder)
    result = upload(merged_folder)

    assert tree_digest(merged_folder) == before  # the card was never written into the folder
    download = tmp_path / "download"
    snapshot_download("org/ppo-qwen", local_dir=download, endpoint=hub.endpoint, token=WRITER)
    downloaded = {p: d for p, d in tree_digest(download).items() if not p.startswith(".cache/")}
    assert {p: d for p, d in downloaded.items() if p not in ("README.md", ".gitattributes")} == before
    assert (result.repo_id, result.revision, result.url) == ("org/ppo-qwen", "main", f"{hub.endpoint}/org/ppo-qwen")
    assert result.files == len(before) + 1 and set(result.sent) == set(before) | {"README.md"}
    assert (
        result.bytes == sum(p.stat().st_size for p in merged_folder.iterdir()) + (download / "README.md").stat().st_size
    )
    head = hub.repos[("model", "org/ppo-qwen")].branches["main"]
    assert result.commit_url == f"{hub.endpoint}/org/ppo-qwen/commit/{head}"
    assert len(lfs_puts(hub)) == 3  # the weight shards went through LFS, once each


def test_model_card_describes_the_checkpoint(hub, merged_folder):
    upload(merged_folder)
    card = hub.tree("org/ppo-qwen")["README.md"].decode()
    manifest = read_manifest(merged_folder)
    assert not [token for token in TOKENS if token in card]
    assert card.startswith("---\nlibrary_name: transformers\n")
    for row in (
        "| run | `ppo-qwen` |",
        "| step | 7 |",
        "| role | `actor` |",
        "| backend | fsdp |",
        "| world size | 2 |",
        "| dtype | float32 |",
        f"| tool | merge_pipeline {__version__} |",
    ):
        assert row in card
    assert f"| source checkpoint | `{manifest['source']['role_dir']}` |" in card
    for path, entry in manifest["files"].items():
        assert f"| `{path}` | {entry['size']:,} | `{entry['sha256']}` |" in card


def test_private_repo_refuses_download_without_token(hub, merged_folder, tmp_path):
    upload(merged_folder, private=True)

    assert hub.repos[("model", "org/ppo-qwen")].private
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download("org/ppo-qwen", cache_dir=tmp_path / "anonymous", endpoint=hub.endpoint, token=False)
    with pytest.raises(RepositoryNotFoundError):  # a valid token without access to the org
        snapshot_download("org/ppo-qwen", cache_dir=tmp_path / "outsider", endpoint=hub.endpoint, token=OUTSIDER)
    assert snapshot_download("org/ppo-qwen", cache_dir=tmp_path / "member", endpoint=hub.endpoint, token=READER)


def test_private_does_not_change_an_existing_public_repo(hub, merged_folder, caplog):
    upload(merged_folder)
    upload(merged_folder, private=True)

    assert not hub.repos[("model", "org/ppo-qwen")].private
    assert "hub: org/ppo-qwen already exists and is public: --private only applies to a new repo" in caplog.text


def test_revision_is_a_branch_created_if_missing(hub, merged_folder):
    result = upload(merged_folder, revision="step-7", commit_message="PPO step 7")

    repo = hub.repos[("model", "org/ppo-qwen")]
    assert set(hub.tree("org/ppo-qwen", "main")) == {".gitattributes"}  # main untouched
    assert set(hub.tree("org/ppo-qwen", "step-7")) == {
        *read_manifest(merged_folder)["files"],
        MANIFEST,
        "README.md",
        ".gitattributes",
    }
    assert repo.resolve("step-7").message == "PPO step 7"
    assert result.url == f"{hub.endpoint}/org/ppo-qwen/tree/step-7"
    assert upload(merged_folder, revision="step-7").sent == ()  # exists now: reused, nothing sent


def test_default_commit_message_names_the_checkpoint(hub, merged_folder):
    upload(merged_folder)
    assert (
        hub.repos[("model", "org/ppo-qwen")].resolve("main").message
        == f"Upload ppo-qwen/global_step_7/actor (merge_pipeline {__version__})"
    )


def test_rerun_sends_only_what_is_missing_and_removes_stale_files(hub, merged_folder):
    upload(merged_folder)
    hub.commit("org/ppo-qwen", {"model-00004-of-00004.safetensors": b"from another merge"}, ["config.json"])
    puts_before = len(lfs_puts(hub))

    result = upload(merged_folder)

    last = hub.repos[("model", "org/ppo-qwen")].resolve("main")
    assert (last.added, last.deleted) == (["config.json"], ["model-00004-of-00004.safetensors"])
    assert result.sent == ("config.json",)
    assert len(lfs_puts(hub)) == puts_before
    assert upload(merged_folder).sent == ()  # and once complete, a re-run sends nothing at all
    assert hub.repos[("model", "org/ppo-qwen")].resolve("main") is last


def test_5xx_on_the_first_commit_is_retried_without_resending_data(hub, merged_folder, caplog):
    hub.fail("POST", "/commit/main$", status=503)

    upload(merged_folder)

    assert [r.status for r in hub.sent("POST", "/commit/main$")] == [503, 200]
    assert len(lfs_puts(hub)) == len(set(lfs_puts(hub))) == 3  # the second attempt sent no LFS data again
    assert (
        "hub: attempt 1 of 3 failed (HTTP 503 on POST /api/models/org/ppo-qwen/commit/main); retrying in 0.01 s"
        in caplog.text
    )


def test_dropped_connection_during_an_lfs_upload_is_retried(hub, merged_folder):
    hub.drop("PUT", "^/lfs/")

    upload(merged_folder)

    puts = hub.sent("PUT", "^/lfs/")
    assert [r.status for r in puts].count(None) == 1 and len(puts) == 4
    dropped = next(r.path for r in puts if r.status is None)
    assert [r.path for r in puts if r.status == 200].count(dropped) == 1  # the same file, sent again whole
    assert hub.tree("org/ppo-qwen").keys() >= {p.name for p in merged_folder.iterdir()}


def test_resume_after_a_failed_run_sends_only_the_commit(hub, merged_folder):
    hub.fail("POST", "/commit/main$", status=502, times=FAST.attempts)
    with pytest.raises(MergeError) as failed:
        upload(merged_folder)
    assert str(failed.value) == (
        f"org/ppo-qwen: the Hub at {hub.endpoint} failed (HTTP 502 on POST /api/models/org/ppo-qwen/commit/main): "
        f"resume with `merge-pipeline upload {merged_folder} org/ppo-qwen` (files already on the Hub are not sent again)"
    )
    first_run = len(hub.requests)

    upload(merged_folder)

    second_run = hub.requests[first_run:]
    assert not [r for r in second_run if r.method == "PUT"]  # the LFS objects were kept
    assert [r.status for r in second_run if r.path.endswith("/commit/main")] == [200]


def test_a_hub_holding_other_bytes_fails_loudly(hub, merged_folder):
    hub.corrupt("model-00002-of-00003.safetensors")
    with pytest.raises(MergeError) as error:
        upload(merged_folder)

    stored = json.loads(hub.tree("org/ppo-qwen")[MANIFEST])["files"]["model-00002-of-00003.safetensors"]["sha256"]
    head = hub.repos[("model", "org/ppo-qwen")].branches["main"]
    bad = hashlib.sha256(hub.tree("org/ppo-qwen")["model-00002-of-00003.safetensors"]).hexdigest()
    assert (
        str(error.value)
        == f"org/ppo-qwen@main (commit {head[:12]}) does not hold what was merged: model-00002-of-00003.safetensors has sha256 {bad} on the Hub, {stored} in the manifest"
    )


def test_local_problems_are_refused_before_any_upload(hub, merged_folder, tmp_path):
    folder = shutil.copytree(merged_folder, tmp_path / "changed")
    with pytest.raises(MergeError, match=r"^'ppo-qwen' is not a Hub repo id: expected ORG/NAME$"):
        upload(folder, "ppo-qwen")
    (folder / "config.json").write_text((folder / "config.json").read_text().replace("float32", "bfloat16"))
    with pytest.raises(
        MergeError,
        match=r"config\.json: changed since the merge \(sha256 \w+, merge_manifest.json says \w+\): merge again$",
    ):
        upload(folder)
    (folder / "extra.txt").write_text("x")
    with pytest.raises(
        MergeError, match=r"changed: does not match its merge_manifest.json \(not listed: extra.txt\): merge again$"
    ):
        upload(folder)
    (folder / MANIFEST).unlink()
    with pytest.raises(
        MergeError,
        match=r"changed: has no merge_manifest.json: only folders written by `merge-pipeline merge` can be uploaded$",
    ):
        upload(folder)
    assert not [r for r in hub.requests if r.method in ("POST", "PUT")]  # refused before writing anything


def test_a_file_changed_after_its_check_is_refused_before_the_commit(hub, merged_folder, tmp_path):
    """The client hashes what it sends; bytes other than those checked against the manifest never reach a commit."""
    folder = shutil.copytree(merged_folder, tmp_path / "changing")
    weights = folder / "model-00002-of-00003.safetensors"
    hub.before("GET", r"/tree/", lambda: weights.write_bytes(bytes(weights.stat().st_size)))  # checked by then
    with pytest.raises(MergeError) as refused:
        upload(folder)
    assert re.fullmatch(
        rf"{weights}: changed while it was being uploaded \(sha256 \w+, expected \w+\): nothing was committed",
        str(refused.value),
    )
    assert not hub.sent("POST", "/commit/") and not lfs_puts(hub)


def test_an_unreachable_hub_is_retried_then_reported(hub, merged_folder, monkeypatch, caplog):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)

    with pytest.raises(MergeError) as error:
        upload(merged_folder)

    assert re.fullmatch(
        rf"org/ppo-qwen: cannot reach {endpoint} \(ConnectError: .*[Cc]onnection refused on POST /api/repos/create\): "
        rf"resume with `merge-pipeline upload {re.escape(str(merged_folder))} org/ppo-qwen` \(files already on the Hub are not sent again\)",
        str(error.value),
    )
    assert caplog.text.count("hub: attempt") == FAST.attempts - 1


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "bad token",
            "{endpoint} rejected the token (401 Unauthorized): set HF_TOKEN to a valid token or run `hf auth login`",
        ),
        (
            "read-only token",
            'org/ppo-qwen: the token may not write there (403 Forbidden: You don\'t have the rights to write a model under the namespace "org"): use a token with write access to org',
        ),
        (
            "other namespace",
            'org/ppo-qwen: the token may not write there (403 Forbidden: You don\'t have the rights to write a model under the namespace "org"): use a token with write access to org',
        ),
        (
            "not a hub",
            "org/ppo-qwen: not found at {endpoint} (HTTP 404 on POST /not-a-hub/api/repos/create): check HF_ENDPOINT, the repo name, and that the token can see it",
        ),
        ("dataset repo", "org/ppo-qwen exists on {endpoint} as a dataset repo, not a model repo: choose another name"),
        ("no token", "no Hugging Face token for {endpoint}: set HF_TOKEN or run `hf auth login`"),
    ],
)
def test_errors_are_one_line_and_never_show_the_token(
    hub, merged_folder, monkeypatch, tmp_path, capsys, caplog, case, expected
):
    endpoint = hub.endpoint
    if case == "bad token":
        monkeypatch.setenv("HF_TOKEN", "hf_notAtoken" + WRITER)  # contains a real token: must not leak either
    elif case == "read-only token":
        monkeypatch.setenv("HF_TOKEN", READER)
    elif case == "other namespace":
        monkeypatch.setenv("HF_TOKEN", OUTSIDER)
    elif case == "not a hub":
        endpoint = f"{hub.endpoint}/not-a-hub"
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
    elif case == "dataset repo":
        hub.add_repo("org/ppo-qwen", repo_type="dataset")
    elif case == "no token":
        monkeypatch.delenv("HF_TOKEN")
        # No stored login either (huggingface_hub fixed its token path at import, before HF_HOME was set).
        monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-login"))

    with pytest.raises(MergeError) as error:
        upload(merged_folder)

    assert str(error.value) == expected.format(endpoint=endpoint)
    assert "\n" not in str(error.value)
    seen = str(error.value) + "".join(capsys.readouterr()) + caplog.text + repr(error.value.__cause__)
    assert not [token for token in TOKENS if token in seen]


USER_FILES = {
    "NOTES.md": b"lr 1e-6 was too high\n",
    "eval/gsm8k.json": b'{"accuracy": 0.71}\n',
    "model_extra.py": b"# user code\n",
}


def test_a_new_merge_removes_only_the_stale_files_of_our_earlier_upload(hub, merged_folder, unsharded_folder):
    upload(unsharded_folder)  # an earlier upload of ours: one model.safetensors, no index
    hub.commit("org/ppo-qwen", USER_FILES)  # then the user adds notes and eval results

    result = upload(merged_folder)  # the next merge: three shards and an index

    last = hub.repos[("model", "org/ppo-qwen")].resolve("main")
    assert last.deleted == ["model.safetensors"]  # the stale weights of our earlier upload
    tree = hub.tree("org/ppo-qwen")
    assert {p: tree[p] for p in USER_FILES} == USER_FILES  # the user's files, byte for byte
    assert set(tree) == {*tree_digest(merged_folder), "README.md", ".gitattributes", *USER_FILES}
    assert result.files == len(tree_digest(merged_folder)) + 1
    assert upload(merged_folder).sent == ()  # kept files do not fail the verification or a re-run


def test_weights_we_did_not_publish_are_refused_not_deleted(hub, merged_folder):
    hub.add_repo("org/ppo-qwen")
    hub.commit("org/ppo-qwen", {"model.safetensors": b"someone else's model", **USER_FILES})
    before = hub.repos[("model", "org/ppo-qwen")].branches["main"]

    with pytest.raises(MergeError) as error:
        upload(merged_folder)

    assert str(error.value) == (
        "org/ppo-qwen@main holds model.safetensors, not published by merge_pipeline, that loaders would read with the merged weights: "
        "delete it there or upload to another --revision"
    )
    assert hub.repos[("model", "org/ppo-qwen")].branches["main"] == before  # nothing committed


def test_a_readme_we_did_not_write_is_kept_without_the_card(hub, merged_folder, caplog):
    readme = b"# Our PPO model\n\nHand-written, with the eval table.\n"
    hub.add_repo("org/ppo-qwen")
    hub.commit("org/ppo-qwen", {"README.md": readme})

    result = upload(merged_folder)

    tree = hub.tree("org/ppo-qwen")
    assert tree["README.md"] == readme
    assert set(tree) == {*tree_digest(merged_folder), "README.md", ".gitattributes"}
    assert "README.md" not in result.sent and result.files == len(tree_digest(merged_folder))
    assert (
        "hub: org/ppo-qwen@main: its README.md was not written by merge_pipeline: kept as it is, without the model card"
        in caplog.text
    )
    assert upload(merged_folder).sent == ()


def test_a_readme_we_did_not_write_is_kept_even_where_our_manifest_records_one(hub, merged_folder):
    """A checkpoint that carried a README.md: our manifest records it, the Hub's README is now the user's."""
    upload(merged_folder)
    manifest = json.loads(hub.tree("org/ppo-qwen")[MANIFEST])
    manifest["files"]["README.md"] = {"size": 1, "sha256": "0" * 64}
    readme = b"# Rewritten by the user\n"
    hub.commit("org/ppo-qwen", {"README.md": readme, MANIFEST: json.dumps(manifest).encode()})

    upload(merged_folder)

    assert hub.tree("org/ppo-qwen")["README.md"] == readme
    assert hub.repos[("model", "org/ppo-qwen")].resolve("main").deleted == []


def test_text_added_around_our_card_is_kept_when_the_card_is_replaced(hub, merged_folder, unsharded_folder):
    upload(merged_folder)
    card = hub.tree("org/ppo-qwen")["README.md"].decode()
    assert card.count(CARD_START) == card.count(CARD_END) == 1
    edited = card.replace(CARD_START, "Read the eval section first.\n" + CARD_START) + "\n## Eval\n\ngsm8k 0.71\n"
    hub.commit("org/ppo-qwen", {"README.md": edited.encode()})

    upload(unsharded_folder)

    readme = hub.tree("org/ppo-qwen")["README.md"].decode()
    assert readme.startswith(card[: card.index(CARD_START)] + "Read the eval section first.\n" + CARD_START)
    assert readme.endswith(CARD_END + "\n\n## Eval\n\ngsm8k 0.71\n")
    assert "| step | 8 |" in readme and "| step | 7 |" not in readme
    assert "model-00001-of-00003.safetensors" not in readme and "| `model.safetensors` |" in readme


def test_a_hub_that_never_answers_times_out_then_is_retried_then_reported(hub, merged_folder, monkeypatch, caplog):
    monkeypatch.setenv("MERGE_PIPELINE_HUB_TIMEOUT", "0.5")
    with silent_endpoint() as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        started = time.monotonic()
        with pytest.raises(MergeError) as error:
            upload(merged_folder)
        elapsed = time.monotonic() - started

    assert str(error.value).startswith(
        f"org/ppo-qwen: cannot reach {endpoint} (ReadTimeout: timed out on POST /api/repos/create): resume with"
    )
    assert caplog.text.count("hub: attempt") == FAST.attempts - 1
    assert elapsed < FAST.attempts * 0.5 + 10


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_timeout_is_one_line(hub, merged_folder, monkeypatch, value):
    monkeypatch.setenv("MERGE_PIPELINE_HUB_TIMEOUT", value)
    with pytest.raises(MergeError) as error:
        upload(merged_folder)
    assert (
        str(error.value)
        == f"MERGE_PIPELINE_HUB_TIMEOUT is {value!r}: expected a finite number of seconds > 0 and <= 86400"
    )
    assert not hub.requests


@pytest.mark.parametrize(("status", "times"), [(403, 1), (503, FAST.attempts)])
def test_a_server_that_echoes_the_token_does_not_get_it_printed(hub, merged_folder, capsys, caplog, status, times):
    """A proxy quoting the request headers (Authorization included) in its error: through retries, the
    one line, and the traceback `-v` would print."""
    hub.fail("POST", "/api/repos/create$", status=status, times=times, echo_headers=True)

    with pytest.raises(MergeError) as error:
        upload(merged_folder)

    assert "\n" not in str(error.value)
    seen = "".join(traceback.format_exception(error.value)) + "".join(capsys.readouterr()) + caplog.text
    assert str(error.value) in seen and not [token for token in TOKENS if token in seen]
    if status == 403:
        assert "Bearer hf_***" in str(error.value)  # the server's message, redacted
