"""``evaluation``: a command run through Dagster Pipes on a merged step, its metrics on the asset, in the
folder's manifest and in the model card's model-index; a threshold as a blocking check that the Hub's
schedule obeys. One merged step (and its report) shared by the module's tests, in the order written."""

from __future__ import annotations

import math
import shutil
import sys

import dagster as dg
import pytest

from merge_pipeline.dagster.evaluation import THRESHOLD_CHECK, evaluation_definitions
from merge_pipeline.dagster.hub_model import HuggingFaceHub, hub_definitions
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.hf.evaluation_result import Threshold
from merge_pipeline.hf.manifest import MANIFEST, read_manifest, sha256_file
from merge_pipeline.hub.model_card import CARD
from merge_pipeline.watch.keys import HUB_CRON, SMOKE_LOSS, THRESHOLD_MET
from merge_pipeline_tests.dagster.helpers import ACTOR, CHAIN, PROJECT_ROOT, Roots, asset, materialize
from merge_pipeline_tests.hub.conftest import WRITER, hub  # noqa: F401 (the fake Hub fixture)

KEY = "run/global_step_1/actor"
evaluation, step_report, hub_model = asset("evaluation"), asset("step_report"), asset("hub_model")
# a user's evaluation: a script of theirs reporting a metric through dagster_pipes, given the folder as {folder}
USER_SCRIPT = """
import sys
from pathlib import Path
from dagster_pipes import open_dagster_pipes
with open_dagster_pipes() as pipes:
    folder = Path(sys.argv[1])
    assert folder == Path(pipes.get_extra("folder"))
    pipes.report_asset_materialization(metadata={"files": len(list(folder.iterdir())), "note": "text is no metric"})
"""


@pytest.fixture(scope="module")
def merged(fsdp_checkpoint, tmp_path_factory):
    """(roots, instance) with KEY merged and reported once for the module."""
    base = tmp_path_factory.mktemp("evaluation")
    roots = Roots(base / "checkpoints", base / "merged")
    home = base / "dagster_home"
    home.mkdir()
    shutil.copy(PROJECT_ROOT / "dagster.yaml", home)
    with dg.DagsterInstance.from_config(str(home)) as instance:
        roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1, link=True)
        assert materialize(instance, roots.settings(), KEY, selection=[*CHAIN, step_report]).success
        yield roots, instance


def evaluate(instance, settings, definition=evaluation) -> dg.ExecuteInProcessResult:
    return dg.materialize(
        [definition], partition_key=KEY, instance=instance, resources={"settings": settings}, raise_on_error=False
    )


def metadata_of(result) -> dict:
    [event] = result.get_asset_materialization_events()
    return event.materialization.metadata


@pytest.mark.parametrize(("threshold", "published"), [("files >= 1", True), ("files >= 1000", False)])
def test_the_threshold_is_a_blocking_check_and_the_hub_publishes_only_a_step_that_met_it(
    merged, tmp_path, threshold, published
):
    roots, instance = merged
    script = tmp_path / "my_eval.py"
    script.write_text(USER_SCRIPT)
    settings = roots.settings(evaluation_command=f"{sys.executable} {script} {{folder}}")
    gated, _job = evaluation_definitions(Names(), Threshold.parse(threshold, "test"))
    _hub_model, schedule = hub_definitions(Names(), HUB_CRON, True, gated=True)
    hub_resource = HuggingFaceHub(organization="org", token=WRITER)

    def tick():
        return schedule(dg.build_schedule_context(instance=instance, resources={"hub": hub_resource}))

    result = evaluate(instance, settings, gated)

    [check] = result.get_asset_check_evaluations()
    assert (check.check_name, check.passed, result.success) == (THRESHOLD_CHECK, published, published)
    assert metadata_of(result)[THRESHOLD_MET].value is published
    requests = tick()  # (before any test here publishes the step)
    if published:
        assert [r.partition_key for r in requests] == [KEY]
    else:
        assert isinstance(requests, dg.SkipReason)


def test_the_default_evaluation_records_the_smoke_loss_on_the_asset_the_manifest_and_the_card(merged, hub):  # noqa: F811
    roots, instance = merged
    folder = roots.target(KEY)
    sums = read_manifest(folder)["files"]

    result = evaluate(instance, roots.settings())

    assert result.success
    loss = metadata_of(result)[SMOKE_LOSS].value
    assert math.isfinite(loss) and loss > 0
    recorded = read_manifest(folder)
    assert recorded["evaluation"]["metrics"] == {SMOKE_LOSS: loss}
    # the folder still matches its manifest: the evaluation added no file
    assert recorded["files"] == sums and {p.name for p in folder.iterdir()} == {*sums, MANIFEST}
    assert all(sha256_file(folder / name) == entry["sha256"] for name, entry in sums.items())
    published = dg.materialize(
        [hub_model],
        partition_key=KEY,
        instance=instance,
        resources={"settings": roots.settings(), "hub": HuggingFaceHub(organization="org", token=WRITER)},
    )
    assert published.success
    card = hub.tree("org/run-actor", "global_step_1")[CARD].decode()
    front_matter = card.split("---")[1]
    assert "model-index:" in front_matter and f'- name: "{SMOKE_LOSS}"' in front_matter
    assert f"value: {loss!r}" in front_matter


def test_a_users_command_reports_its_metrics_through_pipes(merged, tmp_path):
    roots, instance = merged
    script = tmp_path / "my_eval.py"
    script.write_text(USER_SCRIPT)
    command = f"{sys.executable} {script} {{folder}}"

    result = evaluate(instance, roots.settings(evaluation_command=command))

    assert result.success
    metadata = metadata_of(result)
    files = len(list(roots.target(KEY).iterdir()))
    assert metadata["files"].value == files and metadata["command"].value == command
    assert read_manifest(roots.target(KEY))["evaluation"]["metrics"] == {"files": files}  # the number only


def test_a_failing_command_fails_the_step_in_one_line(merged, tmp_path):
    roots, instance = merged
    before = read_manifest(roots.target(KEY))

    result = evaluate(instance, roots.settings(evaluation_command=f"{sys.executable} -c 'raise SystemExit(3)'"))

    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    message = failure.step_failure_data.error.message
    assert "the evaluation command failed" in message and len(message.strip().splitlines()) == 1
    assert read_manifest(roots.target(KEY)) == before


def test_a_threshold_setting_that_says_nothing_is_refused_in_one_line():
    for text in ("loss < 3", "loss <= much", "<= 3", "loss >= nan"):
        with pytest.raises(Exception, match=r"expected '<metric> <= <number>'") as refused:
            Threshold.parse(text, "MERGE_PIPELINE_EVALUATION_THRESHOLD")
        assert "MERGE_PIPELINE_EVALUATION_THRESHOLD" in str(refused.value)


def test_a_folder_merged_again_while_evaluated_keeps_its_new_manifest(merged, tmp_path):
    roots, instance = merged
    manifest = roots.target(KEY) / MANIFEST
    kept = manifest.read_bytes()
    script = tmp_path / "remerged.py"  # stands for a merge publishing the step again while the command runs
    script.write_text(
        "import json, sys\nfrom pathlib import Path\nfrom dagster_pipes import open_dagster_pipes\n"
        "with open_dagster_pipes() as pipes:\n"
        "    manifest = Path(sys.argv[1]) / 'merge_manifest.json'\n"
        "    body = json.loads(manifest.read_text()); body['seconds'] = -1.0; manifest.write_text(json.dumps(body))\n"
        "    pipes.report_asset_materialization(metadata={'score': 1.0})\n"
    )
    try:
        result = evaluate(instance, roots.settings(evaluation_command=f"{sys.executable} {script} {{folder}}"))

        assert not result.success
        [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
        assert "was merged again while it was evaluated" in failure.step_failure_data.error.message
        assert read_manifest(roots.target(KEY))["seconds"] == -1.0 and "score" not in manifest.read_text()
    finally:
        manifest.write_bytes(kept)
