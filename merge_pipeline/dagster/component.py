"""``MergeCheckpoints``: the whole merge (assets, the report and its checks, sensors, Hub schedule, alerts) as one Dagster component.

In any ``dg`` project::

    dg scaffold defs merge_pipeline.MergeCheckpoints cluster_a    # writes defs/cluster_a/defs.yaml
    dg check defs && dg list defs                                  # cluster_a/checkpoint ... cluster_a__new_checkpoint_sensor

Each instance takes its own prefix (default: its folder's name) for asset keys, partitions, job /
sensor / schedule names and resource keys (``names.Names``), so two instances (two training
clusters) in one project never collide. This project's own code location (``definitions.py``) is the
instance with no prefix whose settings come from the environment (``MergeCheckpoints.from_env``).
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Annotated, Any, Literal

import click
import dagster as dg
from pydantic import Field, ValidationInfo, field_validator

from merge_pipeline.dagster.alerts import AlertWebhook, failure_webhook
from merge_pipeline.dagster.assets import checkpoint_spec, merge_step_definition
from merge_pipeline.dagster.averaging import Averaging, averaged_model_definition, averaged_model_sensor_definition
from merge_pipeline.dagster.config import checked_merge_config
from merge_pipeline.dagster.hub import (
    CRON,
    DEFAULT_TEMPLATE,
    HuggingFaceHub,
    env_token,
    hub_averaged_definition,
    hub_definitions,
)
from merge_pipeline.dagster.hub_averaged_schedule import publish_averaged_schedule
from merge_pipeline.dagster.names import Names
from merge_pipeline.dagster.numeric_settings import FRESHNESS, NUMERIC_SETTINGS, SENSOR_INTERVAL
from merge_pipeline.dagster.report import step_report_definition
from merge_pipeline.dagster.report_sensor import step_report_sensor_definition
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.dagster.sensors import checkpoint_sensor

INSTANCE_SETTINGS = Path(__file__).parents[1] / "dagster" / "instance.yaml"


class HubPublishing(dg.Model):
    organization: str = ""  # empty: publishing is off (the schedule stopped, hub_model records nothing)
    private: bool = True
    repo_template: str = DEFAULT_TEMPLATE
    revisions: Literal["branch", "commit"] = "branch"
    schedule: str = CRON  # cron of publish_latest_steps


class MergeCheckpointsScaffolder(dg.Scaffolder):
    """``dg scaffold defs merge_pipeline.MergeCheckpoints <name>``: a defs.yaml naming every setting, and
    the instance settings (``dagster.yaml``) in a project root that has none."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        if request.project_root is not None:
            click.echo(_write_instance_settings(request.project_root))
        request.target_path.mkdir(parents=True, exist_ok=True)
        prefix = request.target_path.name.replace("-", "_")
        (request.target_path / "defs.yaml").write_text(
            textwrap.dedent(f"""\
                type: {request.type_name}
                attributes:
                  # asset keys {prefix}/..., jobs, sensors and schedules {prefix}__...
                  prefix: {prefix}
                  checkpoint_roots: [/data/{prefix}/checkpoints]
                  output_root: /data/{prefix}/merged
                  settle_seconds: 60
                  # merge and report runs of this instance at once (the sensors hold back the rest);
                  # 0: all, for an instance whose run queue limits them (docs/DAGSTER.md, "The component")
                  max_concurrent_merges: 1
                  # for checkpoints without a config of their own (torchtitan, NeMo-RL, ...)
                  # hf_model_path: /models/base
                  # hard-link a complete step until its merge is done (the trainer's rotation may delete it)
                  pin_steps: false
                  # after the merge: a few greedy tokens and a loss on CPU, in step_report and the model card
                  smoke_test: false
                  smoke_max_size: 2GB
                  hub:
                    # set to publish (token: $HF_TOKEN); empty: the schedule stays off
                    organization: ""
                    schedule: "*/10 * * * *"
                  # the merge step's config for the sensor's runs, e.g. weights written by Ray tasks
                  # on the trainer's cluster (pip install 'merge_pipeline[ray]'; docs/DAGSTER.md):
                  # merge_config:
                  #   launcher: ray
                  #   ray_address: ray://raycluster-head-svc:10001
                  #   ray_resource: merge
                  # average the newest K merged steps of each run when a step lands (averaged_model)
                  # averaging:
                  #   last_k: 3
                  #   scheme: uniform    # or ema (ema_decay: 0.9), or weighted (weights: [1, 2, 3])
                  #   dtype: auto
                """)
        )


def _write_instance_settings(project_root: Path) -> str:
    """A new project's instance has no run queue limits, DEBUG event logs, no run monitoring and no
    retries: this package's instance settings, written where ``dg dev`` reads them. What it did, in one line."""
    written = project_root / "dagster.yaml"
    if written.exists() or (project_root / "dagster.yml").exists():
        return f"{written.name} kept as it is; merge_pipeline's instance settings are in {INSTANCE_SETTINGS}"
    shutil.copyfile(INSTANCE_SETTINGS, written)
    return (
        f"wrote {written}: merge_pipeline's instance settings (one heavy run at a time, INFO logs, run "
        "monitoring and retries); `dg dev` reads it here, with DAGSTER_HOME set copy it there"
    )


def _as_written(context: dg.ResolutionContext, value: object) -> object:
    return value


@dg.scaffold_with(MergeCheckpointsScaffolder)
class MergeCheckpoints(dg.Component, dg.Resolvable, dg.Model):
    """Merge every checkpoint a trainer saves under ``checkpoint_roots`` into a verified Hugging Face
    folder under ``output_root``, and optionally publish it to a Hub."""

    prefix: str | None = None  # none: the component folder's name; "": no prefix (this project's own location)
    checkpoint_roots: list[str] | None = None  # none: $MERGE_PIPELINE_CHECKPOINT_ROOTS at run time
    output_root: str | None = None  # none: $MERGE_PIPELINE_OUTPUT_ROOT
    settle_seconds: float | None = None  # none: $MERGE_PIPELINE_SETTLE_SECONDS, else 60
    hf_model_path: str | None = None  # none: $MERGE_PIPELINE_HF_MODEL_PATH
    pin_steps: bool | None = None  # none: $MERGE_PIPELINE_PIN_STEPS, else off
    pin_root: str | None = None  # none: $MERGE_PIPELINE_PIN_ROOT, else <checkpoint root>/.merge_pins
    smoke_test: bool | None = None  # none: $MERGE_PIPELINE_SMOKE_TEST, else off
    smoke_prompt: str | None = None  # none: $MERGE_PIPELINE_SMOKE_PROMPT, else a fixed one
    smoke_max_size: str | None = None  # none: $MERGE_PIPELINE_SMOKE_MAX_SIZE, else 2GB of weights
    # defs.yaml may say any number (10, 10.0, .nan): the check below answers it in one line, not dg's int model
    sensor_interval_seconds: Annotated[int, dg.Resolver(_as_written, model_field_type=float | str)] = (
        SENSOR_INTERVAL.default
    )
    freshness_minutes: float = FRESHNESS.default
    # Merge and report runs of this instance queued or running at once; the sensors hold back the rest
    # (0: they request them all, for an instance whose run queue limits them, as this project's dagster.yaml does).
    max_concurrent_merges: int = Field(default=1, ge=0)
    alert_webhook_url: str | None = None  # none: $MERGE_PIPELINE_ALERT_WEBHOOK_URL, else no alerts
    hub: HubPublishing = HubPublishing()
    averaging: Averaging | None = None  # none: no averaged_model (issue 40: the newest K merged steps of each run)
    # The merge step's config (hf_model's run config fields) for the runs the sensor starts, e.g. the
    # Ray launcher: {launcher: ray, ray_address: "ray://head:10001"}; checked when the definitions load.
    merge_config: dict[str, Any] | None = None

    @field_validator(*NUMERIC_SETTINGS, mode="before")
    @classmethod
    def _numeric_setting(cls, value: object, field: ValidationInfo) -> object:
        """defs.yaml's numbers pass the environment's check: one line naming the field, not pydantic's report."""
        setting = NUMERIC_SETTINGS[field.field_name]
        return None if value is None else setting.checked(value, f"defs.yaml {setting.field}")

    @classmethod
    def from_env(cls) -> MergeCheckpoints:
        """This project's own location: no prefix; what is fixed when the location loads read now, the
        rest (roots, settle time, webhook) read from the environment each time a run or tick uses it."""
        hub = HuggingFaceHub.from_env()
        return cls(
            prefix="",
            max_concurrent_merges=0,  # this project's dagster.yaml queues them, one at a time
            sensor_interval_seconds=SENSOR_INTERVAL.from_env(),
            freshness_minutes=FRESHNESS.from_env(),
            hub=HubPublishing(
                organization=hub.organization,
                private=hub.private,
                repo_template=hub.repo_template,
                revisions=hub.revisions,
            ),
        )

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return self.definitions(Names(self.prefix if self.prefix is not None else context.path.name))

    def definitions(self, names: Names) -> dg.Definitions:
        hub_model, publish_latest_steps = hub_definitions(names, self.hub.schedule, bool(self.hub.organization))
        merge = dg.Definitions(
            assets=[
                checkpoint_spec(names),
                merge_step_definition(names, self.freshness_minutes),
                step_report_definition(names),
                hub_model,
            ],
            # the sensors' jobs (merge_checkpoint, report_merged_step) and the schedule's (publish_to_hub) come with them
            sensors=[
                checkpoint_sensor(
                    names,
                    self.sensor_interval_seconds,
                    checked_merge_config(self.merge_config or {}) or None,
                    self.max_concurrent_merges,
                ),
                step_report_sensor_definition(names, self.sensor_interval_seconds, self.max_concurrent_merges),
                failure_webhook(names),
            ],
            schedules=[publish_latest_steps],
            resources={
                names("settings"): self.settings(),
                names("hub"): HuggingFaceHub(
                    organization=self.hub.organization,
                    private=self.hub.private,
                    repo_template=self.hub.repo_template,
                    revisions=self.hub.revisions,
                    token=env_token(),
                ),
                names("alert_webhook"): AlertWebhook(url=self.alert_webhook_url),
            },
        )
        if self.averaging is None:
            return merge
        averaging = dg.Definitions(
            assets=[
                averaged_model_definition(names, self.averaging, checked_merge_config(self.merge_config or {})),
                # its Hub upload (materialized from the UI, or by its schedule)
                *([hub_averaged_definition(names)] if self.hub.organization else []),
            ],
            sensors=[
                averaged_model_sensor_definition(
                    names, self.sensor_interval_seconds, self.averaging, self.max_concurrent_merges
                )
            ],
            # hub_averaged_model's schedule, with it: on by default where Hub publishing is configured
            schedules=[publish_averaged_schedule(names, self.hub.schedule)] if self.hub.organization else [],
        )
        return dg.Definitions.merge(merge, averaging)

    def settings(self) -> MergeSettings:
        return MergeSettings(
            checkpoint_roots=self.checkpoint_roots,
            output_root=self.output_root,
            settle_seconds=self.settle_seconds,
            hf_model_path=self.hf_model_path,
            pin_steps=self.pin_steps,
            pin_root=self.pin_root,
            smoke_test=self.smoke_test,
            smoke_prompt=self.smoke_prompt,
            smoke_max_size=self.smoke_max_size,
        )
