"""``promote_best_steps`` (``promote_best_by``): each run's best evaluated step promoted on the test Hub, by a
user's metric reported through Dagster Pipes; never a step that missed the threshold; no sensor unset."""

from __future__ import annotations

import json
import sys

import dagster as dg
import pytest

from merge_pipeline.dagster.component import HubPublishing, MergeCheckpoints
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline_tests.dagster.helpers import ACTOR
from merge_pipeline_tests.hub.conftest import hub  # noqa: F401 (the fake Hub fixture)

# the user's evaluation: its score for the step folder it is given, reported through dagster_pipes
SCORE_SCRIPT = """
import json, sys
from pathlib import Path
from dagster_pipes import open_dagster_pipes
with open_dagster_pipes() as pipes:
    scores = json.loads(Path(sys.argv[2]).read_text())
    pipes.report_asset_materialization(metadata={"score": scores[Path(sys.argv[1]).parent.name]})
"""
# step 3 scores best but misses the threshold; step 4 is later and better than step 2; step 5 later and worse;
# step 6 ties with step 4: the newer step wins
SCORES = {f"global_step_{n}": score for n, score in enumerate((0.5, 0.8, 0.95, 0.85, 0.6, 0.85), 1)}


def key(step: int) -> str:
    return f"run/global_step_{step}/actor"


def test_the_best_evaluated_step_of_a_run_is_promoted_once_and_a_better_later_one_after_it(
    hub,  # noqa: F811
    fsdp_checkpoint,
    roots,
    instance,
    tmp_path,
):
    sample = fsdp_checkpoint(ACTOR)
    for step in SCORES:
        roots.drop(sample, f"run/{step}", link=True)
    (roots.checkpoints / "run" / TRACKER).write_text("6")
    script, scores = tmp_path / "score.py", tmp_path / "scores.json"
    script.write_text(SCORE_SCRIPT)
    scores.write_text(json.dumps(SCORES))
    built = MergeCheckpoints(
        prefix="c",
        checkpoint_roots=[str(roots.checkpoints)],
        output_root=str(roots.output),
        max_concurrent_merges=0,
        evaluation_command=f"{sys.executable} {script} {{folder}} {scores}",
        evaluation_threshold="score <= 0.9",
        promote_best_by="score max",
        hub=HubPublishing(organization="org"),
    ).definitions(Names("c"))
    sensor = built.resolve_sensor_def("c__promote_best_steps")
    instance.add_dynamic_partitions("c__checkpoints", [key(step) for step in range(1, 7)])

    def run(job: str, step: int) -> bool:
        return (
            built.resolve_job_def(f"c__{job}")
            .execute_in_process(instance=instance, partition_key=key(step), raise_on_error=False)
            .success
        )

    def merged_published_evaluated(step: int, publish: bool = True) -> None:
        assert run("merge_checkpoint", step)
        assert not publish or run("publish_to_hub", step)
        assert run("evaluate_merged_step", step) is (SCORES[f"global_step_{step}"] <= 0.9)

    def tick() -> list[tuple[str, str]]:
        answer = sensor(dg.build_sensor_context(instance=instance))
        return [] if isinstance(answer, dg.SkipReason) else [(r.partition_key, r.run_key) for r in answer]

    for step in (1, 2, 3):
        merged_published_evaluated(step)
    [(best, run_key)] = tick()
    assert best == key(2)  # step 3's better score missed the threshold
    assert tick() == [(best, run_key)]  # the same run key: the daemon launches it once
    assert run("promote_step", 2)
    assert tick() == []  # already the promoted step

    merged_published_evaluated(4, publish=False)
    assert tick() == []  # the best now, but promotion commits what hub_model published: not yet on the Hub
    assert run("publish_to_hub", 4)
    [(best, _)] = tick()
    assert best == key(4)
    assert run("promote_step", 4)

    merged_published_evaluated(5)
    assert tick() == []  # later, but worse
    assert hub.tree("org/run-actor", "main") == hub.tree("org/run-actor", "global_step_4")
    merged_published_evaluated(6)
    [(best, _)] = tick()
    assert best == key(6)


def test_the_sensor_exists_only_with_the_setting_and_a_bad_value_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("MERGE_PIPELINE_PROMOTE_BEST_BY", raising=False)
    names = {s.name for s in MergeCheckpoints(prefix="c").definitions(Names("c")).sensors or []}
    assert "c__promote_best_steps" not in names and "c__new_checkpoint_sensor" in names

    monkeypatch.setenv("MERGE_PIPELINE_PROMOTE_BEST_BY", "accuracy max")
    with pytest.raises(MergeError, match=r"promote_best_by is set, but hub: organization is not"):
        MergeCheckpoints(prefix="c").definitions(Names("c"))
    on_hub = MergeCheckpoints(prefix="c", hub=HubPublishing(organization="org"))
    assert "c__promote_best_steps" in {s.name for s in on_hub.definitions(Names("c")).sensors or []}

    monkeypatch.setenv("MERGE_PIPELINE_PROMOTE_BEST_BY", "accuracy best")
    with pytest.raises(MergeError, match=r"MERGE_PIPELINE_PROMOTE_BEST_BY is 'accuracy best': expected '<metric> max'"):
        on_hub.definitions(Names("c"))
