"""``averaged_model``: per run and role, the weighted average of its last K merged steps, an
option of the component (``averaging:`` in defs.yaml; off when absent).

Partitioned by run (``<run_name>/<role>``, dynamic partitions ``averaged_runs``), it depends on the run's
``hf_model`` partitions: its inputs are the newest K published merged folders of the run and role
(each checked before it was published), newest last. The run is ``pipeline.merge`` on their average, as
``merge-pipeline average`` runs it: streamed, the blocking checks on the staging folder, then published
atomically into ``<output_root>/<run_name>/averaged/<role>``, replacing the previous average of the run;
its weights written by the merge step's launcher (``workers.workers_for``: in process, torchrun or Ray, the
component's ``merge_config`` giving the defaults).
Its metadata names each input and its weight, and compares the average with the newest step
(``hf/step_diff``, the step report's table).

``averaged_model_sensor`` reads ``hf_model``'s new materializations: for
each run that gained a merged step and now has at least K, it requests the average (``run_key``: the
run and that merge, so once per landed step), in a run of its own with the heavy tag.
"""

import contextlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

import dagster as dg
from pydantic import Field, create_model, model_validator

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.dagster.checks import checks_metadata
from merge_pipeline.dagster.failures import one_line_failure
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.dagster.run_config import LauncherConfig, config_field, writer_fields
from merge_pipeline.dagster.sensors import heavy_runs_in_flight
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.file_names import WEIGHT_SUFFIXES
from merge_pipeline.options import (
    ACCUMULATE_CHOICES,
    DTYPE_CHOICES,
    EMA_WEIGHTS,
    GIVEN_WEIGHTS,
    MAX_AVERAGED,
    MergeOptions,
    average_weights,
    option_field,
)
from merge_pipeline.progress import human_bytes
from merge_pipeline.store.record import MANIFEST
from merge_pipeline.store.view import viewed
from merge_pipeline.watch.keys import CHECKED, GROUP, HEAVY_TAG, MERGE_POOL, OWNERS
from merge_pipeline.watch.location_settings import OUTPUT_ROOT
from merge_pipeline.watch.partitions import checkpoint_key

AVERAGED = "averaged"  # <output_root>/<run_name>/averaged/<role>
BATCH = 200  # hf_model events read per tick


class Averaging(dg.Model):
    """The component's ``averaging:`` setting: the averaged_model run config's defaults."""

    last_k: int = Field(default=3, description="average the newest K (at least 2) merged steps of each run and role")
    scheme: Literal["uniform", "ema", "weighted"] = Field(
        default="uniform",
        description=f"uniform: equal weights; ema: {EMA_WEIGHTS} (`ema_decay`); weighted: `weights`",
    )
    ema_decay: float = Field(default=0.9, description="scheme ema: the decay, between 0 and 1")
    weights: list[float] | None = Field(
        default=None, description=f"scheme weighted: {GIVEN_WEIGHTS} (an input is a step)"
    )
    # the merge options', with their defaults and choices
    dtype: Literal[DTYPE_CHOICES] = config_field(
        option_field("dtype"), "output dtype (auto: the inputs' own; fp8: the average quantized)"
    )
    accumulate: Literal[ACCUMULATE_CHOICES] = config_field(option_field("average_accumulate"))

    @model_validator(mode="after")
    def _valid(self) -> "Averaging":  # defs.yaml is refused when the component loads
        self.step_weights()
        return self

    def step_weights(self) -> tuple[float, ...]:
        """One weight per step, oldest first; a bad setting is one line."""
        if not 2 <= self.last_k <= MAX_AVERAGED:
            raise MergeError(
                None, f"averaging: last_k {self.last_k}: expected a whole number of steps from 2 to {MAX_AVERAGED:,}"
            )
        if self.scheme == "weighted" and self.weights is None:
            raise MergeError(None, "averaging: scheme weighted needs weights (one per step, oldest first)")
        return average_weights(
            self.last_k,
            weights=self.weights if self.scheme == "weighted" else None,
            ema=self.ema_decay if self.scheme == "ema" else None,
        )


@dataclass(frozen=True)
class RunKey:
    """An averaged_model partition key: ``<run_name>/<role>``, the checkpoint keys' run and role."""

    run_name: str
    role: str

    def __str__(self) -> str:
        return f"{self.run_name}/{self.role}"

    @classmethod
    def of(cls, key: CheckpointName) -> "RunKey":
        return cls(key.run, key.role)

    @classmethod
    def parse(cls, key: str) -> "RunKey":
        run_name, _, role = key.rpartition("/")
        path = PurePosixPath(run_name)
        if not role or str(path) != run_name or path.is_absolute() or ".." in path.parts or role in (".", ".."):
            raise MergeError(None, f"partition key {key!r} is not <run_name>/<role>")
        return cls(run_name, role)


def averaged_partitions(names: Names) -> dg.DynamicPartitionsDefinition:
    return dg.DynamicPartitionsDefinition(name=names("averaged_runs"))


def averaged_dir(settings: MergeSettings, run: RunKey) -> Path:
    return settings.value(OUTPUT_ROOT) / run.run_name / AVERAGED / run.role


def merged_steps(
    instance: dg.DagsterInstance, settings: MergeSettings, run: RunKey, names: Names
) -> list[CheckpointName]:
    """The run's checkpoint partitions of this role whose merged folder is published (it has its
    manifest: written last, before the checks and the rename), oldest first."""
    keys = []
    for partition in instance.get_dynamic_partitions(names.partitions.name):
        try:
            key = checkpoint_key(partition)
        except MergeError:
            continue
        if RunKey.of(key) == run and (settings.target_dir(key) / MANIFEST).is_file():
            keys.append(key)
    return sorted(keys, key=lambda k: k.step)


def averaged_model_definition(
    names: Names, averaging: Averaging, merge_config: dict | None = None
) -> dg.AssetsDefinition:
    """``merge_config``: the component's (checked): the average is written by the merge step's launcher."""
    # The run config: Averaging's fields, with this component's values as defaults (the Launchpad shows
    # them), and the merge step's launcher and shard size, with the merge_config's values as defaults.
    config_class = create_model(
        "AveragedModelConfig",
        __base__=LauncherConfig,
        **{
            name: (field.annotation, Field(default=getattr(averaging, name), description=field.description))
            for name, field in Averaging.model_fields.items()
        },
        **writer_fields(merge_config or {}),
    )

    @dg.asset(
        key=names.key("averaged_model"),
        partitions_def=averaged_partitions(names),
        deps=[dg.AssetDep(names.key("hf_model"), partition_mapping=dg.AllPartitionMapping())],
        group_name=names(GROUP),
        owners=OWNERS,
        kinds={"safetensors", "huggingface"},
        tags={"stage": "averaged"},
        pool=MERGE_POOL,
        required_resource_keys={names("settings")},
    )
    def averaged_model(context: dg.AssetExecutionContext, config: config_class) -> dg.MaterializeResult:
        """The weighted average of the run's newest K merged steps.

        Checked and published as a merge is."""
        settings: MergeSettings = getattr(context.resources, names("settings"))
        # unvalidated: _average checks it, in one line
        chosen = Averaging.model_construct(**{name: getattr(config, name) for name in Averaging.model_fields})
        return _average(context, chosen, config, settings, names)

    return averaged_model


def _average(
    context: dg.AssetExecutionContext,
    averaging: Averaging,
    writer: LauncherConfig,
    settings: MergeSettings,
    names: Names,
) -> dg.MaterializeResult:
    """``writer``: the run config, its launcher (and ``max_shard_size``) deciding who writes the weights."""
    # torch and transformers: imported by the run, not by the code location's load
    from merge_pipeline.dagster.weights import step_workers
    from merge_pipeline.hf.step_diff import diff_folders, markdown_table, summary_lines
    from merge_pipeline.pipeline.merge import merge

    with one_line_failure():
        weights = averaging.step_weights()
        run = RunKey.parse(context.partition_key)
        steps = merged_steps(context.instance, settings, run, names)
        if len(steps) < averaging.last_k:
            raise MergeError(
                None, f"{run}: {len(steps)} merged step(s), last_k is {averaging.last_k}: nothing to average yet"
            )
        chosen = steps[-averaging.last_k :]
        inputs = tuple(str(settings.target_dir(k)) for k in chosen)
        options = MergeOptions(
            dtype=averaging.dtype,
            overwrite=True,  # the run's previous average, replaced once the new one is complete
            average_inputs=inputs,
            average_weights=weights,
            average_accumulate=averaging.accumulate,
            max_shard_size=writer.max_shard_size,
        )
        target = averaged_dir(settings, run)
        with step_workers(context, writer) as workers:
            merged = merge(inputs[-1], target, options, workers=workers, show_progress=False)
        checked = checks_metadata(merged.checks, target)
        with contextlib.ExitStack() as views:  # folders in a store compared through views (ranged GETs)
            diff = diff_folders(
                views.enter_context(viewed(target, WEIGHT_SUFFIXES, merged=True)),
                {"newest step": views.enter_context(viewed(inputs[-1], WEIGHT_SUFFIXES, merged=True))},
            )
    rows = [f"| `{key}` | {weight:.6g} |" for key, weight in zip(chosen, options.average_weights, strict=True)]
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(target)),
            "inputs": dg.MetadataValue.md("\n".join(["| merged step | weight |", "|---|---:|", *rows])),
            "steps": [k.step for k in chosen],
            "scheme": averaging.scheme,
            "accumulate": averaging.accumulate,
            "dtype": merged.manifest["decisions"]["config_dtype"],
            "launcher": writer.launcher_label(),
            "parameters": merged.parameters,
            "bytes written": dg.MetadataValue.int(merged.written.report.bytes),
            merged.written.peak_rss_label: human_bytes(merged.written.peak_rss_bytes),
            "seconds": round(merged.seconds, 3),
            "summary": dg.MetadataValue.md("\n".join(f"- {line}" for line in summary_lines(diff))),
            "largest change vs newest step": diff.max_change("newest step"),
            "table": dg.MetadataValue.md(markdown_table(diff)),
            **checked["hf_model"],
            f"{CHECKED} (weights)": checked["state_dict"][CHECKED],
        }
    )


def averaging_job(names: Names) -> "dg.UnresolvedAssetJobDefinition":
    return dg.define_asset_job(
        names("average_run"),
        selection=dg.AssetSelection.assets(names.key("averaged_model")),
        tags={HEAVY_TAG: "average"},  # it reads K folders and writes one: not beside a merge
        executor_def=dg.in_process_executor,
        description="Average the newest merged steps of a run.\n\nRequested by averaged_model_sensor when a step lands.",
    )


def averaged_model_sensor_definition(
    names: Names, interval_seconds: int, averaging: Averaging, max_concurrent_merges: int = 0
) -> dg.SensorDefinition:
    """``max_concurrent_merges``: no average requested while this many merge, report or average runs of
    this instance are queued or running (0: leave it to the instance's run queue), as the report sensor."""

    @dg.sensor(
        name=names("averaged_model_sensor"),
        job=averaging_job(names),
        minimum_interval_seconds=interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        required_resource_keys={names("settings")},
        description=f"Averages a run's newest {averaging.last_k} merged steps when one lands.\n\nA new hf_model materialization: the newest merged steps of its run and role.",
    )
    def averaged_model_sensor(context: dg.SensorEvaluationContext, **_called_with: object) -> dg.SensorResult:
        return _tick(context, getattr(context.resources, names("settings")), names, averaging, max_concurrent_merges)

    return averaged_model_sensor


def _tick(
    context: dg.SensorEvaluationContext,
    settings: MergeSettings,
    names: Names,
    averaging: Averaging,
    max_concurrent_merges: int,
) -> dg.SensorResult:
    room = BATCH
    if max_concurrent_merges:  # a project without a run queue's limits: an average is not run beside a merge
        room = max_concurrent_merges - heavy_runs_in_flight(context.instance, names)
        if room <= 0:  # the cursor stays: the next tick reads these merges again
            return dg.SensorResult(
                skip_reason="a merge, report or average of this instance is queued or running", cursor=context.cursor
            )
    merges = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(names.key("hf_model"), after_storage_id=int(context.cursor) if context.cursor else None),
        limit=BATCH,
        ascending=True,
    ).records
    landed: dict[RunKey, int] = {}  # run -> its newest merge's storage id
    for record in merges:
        try:
            landed[RunKey.of(checkpoint_key(record.partition_key))] = record.storage_id
        except MergeError:
            continue
    requests, waiting = [], []
    for run, storage_id in landed.items():
        count = len(merged_steps(context.instance, settings, run, names))
        if count < averaging.last_k:
            waiting.append(f"{run} ({count} of {averaging.last_k} merged steps)")
            continue
        requests.append(dg.RunRequest(run_key=f"{run}@{storage_id}", partition_key=str(run)))
    cursor = str(merges[-1].storage_id) if merges else context.cursor
    if len(requests) > room:  # the rest by later ticks: the cursor stays, and a run key is launched once
        requests, cursor = requests[:room], context.cursor
    partitions = averaged_partitions(names)
    known = set(context.instance.get_dynamic_partitions(partitions.name))
    new = sorted({r.partition_key for r in requests} - known)
    if requests:
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[partitions.build_add_request(new)] if new else [],
            cursor=cursor,
        )
    reason = f"waiting for more merged steps: {'; '.join(waiting[:5])}" if waiting else "no new merged step"
    return dg.SensorResult(skip_reason=reason, cursor=cursor)
