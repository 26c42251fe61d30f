"""Promote a published step on the Hub: ``main`` of its repo made to hold exactly the files of the step's
verified commit, without sending a weight byte again.

One commit on ``main``: a server-side copy of every file of the step's commit (``CommitOperationCopy``: the
Hub links an LFS file by its sha256, nothing is uploaded; a small file, config or tokenizer, is fetched and
committed inline) and the deletion of what ``main`` holds beside them. Files already equal on ``main`` are
skipped by the client. ``main``'s tree is then compared with the step's, file by file.
"""

from __future__ import annotations

from dataclasses import dataclass

from huggingface_hub import CommitOperationCopy, CommitOperationDelete, HfApi, constants
from huggingface_hub.hf_api import RepoFile

from merge_pipeline.errors import MergeError
from merge_pipeline.hub.connection import HUB_ERRORS, connect, describe

MAIN = constants.DEFAULT_REVISION


@dataclass(frozen=True)
class Promoted:
    repo_id: str
    source: str  # the step's commit
    commit_url: str  # main's new head; main's head as it was when it already held the step
    files: int
    deleted: tuple[str, ...]


def promote_to_main(
    repo_id: str, source: str, *, endpoint: str | None = None, token: str | None = None, timeout_s: float | None = None
) -> Promoted:
    """``source``: the step's commit (or branch) in ``repo_id``; ``main`` ends holding its files, checked."""
    hub = connect(endpoint, token, timeout_s)
    api = hub.api
    try:
        step, main = _tree(api, repo_id, source), _tree(api, repo_id, MAIN)
        deleted = tuple(sorted(set(main) - set(step)))
        operations = [
            *(
                CommitOperationCopy(path, path, src_revision=source)
                for path in sorted(step)
                if _differs(step, main, path)
            ),
            *(CommitOperationDelete(path) for path in deleted),
        ]
        if operations:
            head = api.create_commit(
                repo_id, operations, commit_message=f"Promote {source[:12]} to {MAIN} (merge_pipeline)", revision=MAIN
            ).oid
        else:
            head = api.repo_info(repo_id, revision=MAIN).sha
        promoted = _tree(api, repo_id, head)
    except HUB_ERRORS as exc:
        problem = f"promoting {source[:12]} to {MAIN} failed at {hub.endpoint} ({describe(exc)})"
        # launched again, it copies only what main still lacks
        raise MergeError(None, hub.redact(f"{repo_id}: {problem}: launch the promotion again")) from None
    differing = sorted(p for p in {*step, *promoted} if _differs(step, promoted, p))
    if differing:
        raise MergeError(
            None, f"{repo_id}@{MAIN} (commit {head[:12]}) does not hold {source[:12]}'s files: {', '.join(differing)}"
        )
    return Promoted(repo_id, source, f"{hub.endpoint}/{repo_id}/commit/{head}", len(step), deleted)


def _tree(api: HfApi, repo_id: str, revision: str) -> dict[str, RepoFile]:
    return {
        e.path: e for e in api.list_repo_tree(repo_id, recursive=True, revision=revision) if isinstance(e, RepoFile)
    }


def _differs(a: dict[str, RepoFile], b: dict[str, RepoFile], path: str) -> bool:
    """Not the same content: a git blob id names it (an LFS file's, its pointer: size and sha256)."""
    return path not in a or path not in b or a[path].blob_id != b[path].blob_id
