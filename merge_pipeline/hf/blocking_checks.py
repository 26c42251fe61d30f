"""The blocking checks of a merged folder: one list, run before publishing by every entry point.

The CLI (one process or torchrun's rank 0) and Dagster's ``hf_model`` run ``run_blocking_checks`` on
the complete staging folder, after the manifest and before the rename into place, so they accept or
refuse the same folders. The manifest names them (``checks_before_publishing``).

Each gets the write report's entries of the merge (``written``): ``manifest_sha256`` compares the weight
files by the sha256 that merge computed while writing them (or while verifying a file a killed merge
finished), for as long as each is still the file it hashed, instead of reading every byte again.

They run where ``hf/check_worker.py`` says: in a worker process started as the weights start being
written, which has imported transformers meanwhile (``prepare_checks``), or in this process when there
is no worker or it gave no answer. The same functions on the same folder either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from merge_pipeline.errors import MergeError

# What a merge computed of its own weight files: relative path -> write report entry (sha256, identity).
Written = Mapping[str, Mapping]


def _folder_check(name: str, *, uses_written: bool = False) -> Callable[[Path, Written], list[str]]:
    """``folder_checks.<name>``, imported when a check runs: it needs torch and transformers, which the
    checks' names and descriptions (all that Dagster's code location reads when it loads) do not."""

    def find_problems(folder: Path, written: Written) -> list[str]:
        from merge_pipeline.hf import folder_checks

        check = getattr(folder_checks, name)
        return check(folder, written) if uses_written else check(folder)

    return find_problems


@dataclass(frozen=True)
class FolderCheck:
    name: str
    find_problems: Callable[[Path, Written], list[str]]
    passed_text: str
    description: str


BLOCKING_CHECKS = (
    FolderCheck(
        "loads_on_meta_device",
        _folder_check("meta_load_problems"),
        "every weight loads into the config's architecture with the stored shape and every stored value unaltered",
        "The folder loads into its architecture, values unaltered.\n\n"
        "transformers builds the architecture config.json names on the meta device from this folder: no missing, unexpected or reshaped keys, each weight loaded in its stored dtype or one holding it exactly",
    ),
    FolderCheck(
        "index_matches_shards",
        _folder_check("index_problems"),
        "the index maps every stored tensor to the file holding it, total_size matches",
        "The index maps exactly the tensors each shard holds.\n\n"
        "model.safetensors.index.json maps exactly the tensors each shard holds, and its total_size is their byte count",
    ),
    FolderCheck(
        "manifest_sha256",
        _folder_check("manifest_problems", uses_written=True),
        "every file matches the manifest's size and sha256",
        "Every file matches merge_manifest.json's size and sha256.\n\n"
        "every file of the folder has the size and sha256 merge_manifest.json records, and no file is unlisted; a weight file still the one this merge wrote (or verified, when resumed) is compared by the sha256 computed then, every other file is hashed",
    ),
)
CHECK_NAMES = [c.name for c in BLOCKING_CHECKS]


@dataclass(frozen=True)
class CheckOutcome:
    check: FolderCheck
    problems: list[str]

    @property
    def passed(self) -> bool:
        return not self.problems


def prepare_checks(architecture: str, model_type: str) -> None:
    """Import what the checks will need for a model of this class and type (the check worker, before
    the folder is complete): transformers, its table of checkpoint renamings, the modeling module."""
    try:
        import transformers
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        from merge_pipeline.hf import folder_checks  # noqa: F401

        # The first call builds (and keeps) every model type's renamings: ~1000 regexes, ~0.8 s.
        get_checkpoint_conversion_mapping(model_type)
        if architecture:
            hasattr(transformers, architecture)  # imports its modeling module, as model_class will
    except Exception:  # noqa: BLE001, S110 - only a head start: the checks themselves report any problem
        pass


def run_blocking_checks(folder: Path, written: Written) -> list[CheckOutcome]:
    """Every blocking check's problems on a complete, not yet published folder (none = passed).

    ``written``: the entries of the write report of the merge that made ``folder`` (see above)."""
    return [CheckOutcome(check, _problems(check, folder, written)) for check in BLOCKING_CHECKS]


def _problems(check: FolderCheck, folder: Path, written: Written) -> list[str]:
    try:
        return check.find_problems(folder, written)
    except Exception as exc:  # noqa: BLE001 - a file that breaks the reader (bad JSON, a config transformers rejects) fails the check, in one line
        return [f"{type(exc).__name__}: {' '.join(str(exc).split())}"]


def refusal(outcomes: list[CheckOutcome]) -> str | None:
    """The one line saying which checks failed and their first problem; None when all passed."""
    failed = [o for o in outcomes if not o.passed]
    if not failed:
        return None
    others = sum(len(o.problems) for o in failed) - 1
    return (
        f"not published: blocking check(s) {', '.join(o.check.name for o in failed)} failed on the merged folder: "
        + failed[0].problems[0]
        + (f" (and {others} more problem(s))" if others else "")
    )


class BlockingChecksFailed(MergeError):
    """The refusal of a folder (``refusal``'s line), with every check's outcome: Dagster records each one as
    the result of its asset check before the step fails."""

    def __init__(self, target: Path, outcomes: list[CheckOutcome]):
        super().__init__(target, refusal(outcomes))
        self.outcomes = outcomes
