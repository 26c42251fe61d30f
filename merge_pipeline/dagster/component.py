"""``MergeCheckpoints``: the whole merge (assets, the report and its checks, sensors, Hub schedule, alerts) as one Dagster component.

In any ``dg`` project::

    dg scaffold defs merge_pipeline.MergeCheckpoints cluster_a    # writes defs/cluster_a/defs.yaml
    dg check defs && dg list defs                                  # cluster_a/checkpoint ... cluster_a__new_checkpoint_sensor

Each instance takes its own prefix (default: its folder's name) for asset keys, partitions, job /
sensor / schedule names and resource keys (``instance_names.Names``), so two instances (two training
clusters) in one project never collide. This project's own code location (``definitions.py``) is the
instance with no prefix whose settings come from the environment (``defs/merge/defs.yaml``).
"""

from __future__ import annotations

from typing import Annotated, Any

import dagster as dg
from pydantic import Field, ValidationInfo, field_validator

from merge_pipeline.dagster.alerts import AlertWebhook, failure_webhook
from merge_pipeline.dagster.assets import checkpoint_spec, merge_step_definition
from merge_pipeline.dagster.averaged_model import Averaging, averaged_model_definition, averaged_model_sensor_definition
from merge_pipeline.dagster.evaluation import evaluation_definitions
from merge_pipeline.dagster.hub_averaged_schedule import publish_averaged_schedule
from merge_pipeline.dagster.hub_model import (
    HuggingFaceHub,
    env_token,
    hub_averaged_definition,
    hub_definitions,
)
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.jobs import report_job
from merge_pipeline.dagster.promoted_model import promotion_definitions
from merge_pipeline.dagster.promotion_sensor import promote_best_sensor
from merge_pipeline.dagster.report import step_report_definition
from merge_pipeline.dagster.report_automation import step_report_automation
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.dagster.run_config import checked_merge_config
from merge_pipeline.dagster.scaffolder import MergeCheckpointsScaffolder
from merge_pipeline.dagster.sensors import checkpoint_sensor
from merge_pipeline.errors import MergeError
from merge_pipeline.watch.keys import HUB_CRON
from merge_pipeline.watch.location_settings import (
    BY_NAME,
    EVALUATION_THRESHOLD,
    FRESHNESS_MINUTES,
    PROMOTE_BEST_BY,
    SENSOR_INTERVAL_SECONDS,
    Setting,
    attributes,
    of_resource,
    with_fields,
)


def _checked(cls, value: object, field: ValidationInfo) -> object:
    """defs.yaml's values pass the environment's check: one line naming the attribute, not pydantic's report."""
    return BY_NAME[field.field_name].check(value)


class HubPublishing(with_fields(dg.Model, attributes("hub"))):
    """The ``hub:`` section: one attribute per Hub setting of ``settings.py`` (the token only from its variable)."""

    schedule: str = HUB_CRON  # cron of publish_latest_steps

    _setting_checked = field_validator(*(s.name for s in attributes("hub")), mode="before")(_checked)

    def resource(self) -> HuggingFaceHub:
        """Every field resolved when the location loads (the attribute, else its variable, else the default),
        so the definitions that hang on the organization and the runs agree; the token stays its variable."""
        return HuggingFaceHub(**{s.name: s.value(getattr(self, s.name)) for s in attributes("hub")}, token=env_token())


def _as_written(context: dg.ResolutionContext, value: object) -> object:
    return value


def _attribute(setting: Setting) -> tuple[Any, Any]:
    """A setting's attribute; a whole number as written in defs.yaml (10, 10.0, .nan), so that the
    check answers it in one line, not dg's int model."""
    kind, field = setting.field()
    if setting.kind.type is int:
        kind = Annotated[kind, dg.Resolver(_as_written, model_field_type=float | str | None)]
    return kind, field


@dg.scaffold_with(MergeCheckpointsScaffolder)
class MergeCheckpoints(dg.Component, dg.Resolvable, with_fields(dg.Model, attributes(), _attribute)):
    """Merge a trainer's checkpoints into verified HF folders.

    Every checkpoint a trainer saves under ``checkpoint_roots`` into a verified Hugging Face folder
    under ``output_root``, optionally published to a Hub. Besides the fields below, one
    attribute per setting of ``settings.py`` (left out: its environment variable, else its default)."""

    prefix: str | None = None  # none: the component folder's name; "": no prefix (this project's own location)
    # Merge and report runs of this instance queued or running at once; the sensors and the report's automation hold back the rest
    # (0: they request them all, for an instance whose run queue limits them, as this project's dagster.yaml does).
    max_concurrent_merges: int = Field(default=1, ge=0)
    hub: HubPublishing = HubPublishing()
    averaging: Averaging | None = None  # none: no averaged_model (the newest K merged steps of each run)
    # The merge step's config (hf_model's run config fields) for every run that gives none of its own (the
    # sensor's, the UI's, dg launch's, merge-pipeline queue's), e.g. the Ray launcher:
    # {launcher: ray, ray_address: "ray://head:10001"}; checked when the definitions load.
    merge_config: dict[str, Any] | None = None

    _setting_checked = field_validator(*(s.name for s in attributes()), mode="before")(_checked)

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return self.definitions(Names(self.prefix if self.prefix is not None else context.path.name))

    def definitions(self, names: Names) -> dg.Definitions:
        hub = self.hub.resource()
        interval = SENSOR_INTERVAL_SECONDS.value(self.sensor_interval_seconds)
        freshness = FRESHNESS_MINUTES.value(self.freshness_minutes)
        threshold = EVALUATION_THRESHOLD.value(self.evaluation_threshold)
        gated = threshold is not None
        hub_model, publish_latest_steps = hub_definitions(names, self.hub.schedule, hub.enabled, gated)
        evaluation, evaluate_job = evaluation_definitions(names, threshold)
        promoted_model, promote_job = promotion_definitions(names)
        best_by = PROMOTE_BEST_BY.value(self.promote_best_by)  # none: no sensor, promotion only by hand
        if best_by and not hub.enabled:  # an evaluated folder is local: only the Hub has a place to promote it to
            raise MergeError(None, "promote_best_by is set, but hub: organization is not: nowhere to promote a step")
        promote_best = [promote_best_sensor(names, promote_job, best_by, gated, interval)] if best_by else []
        merge_config = checked_merge_config(self.merge_config or {})
        merge = dg.Definitions(
            assets=[
                checkpoint_spec(names),
                merge_step_definition(names, freshness, merge_config),
                step_report_definition(names, self.max_concurrent_merges),
                evaluation,
                hub_model,
                promoted_model,
            ],
            jobs=[evaluate_job, promote_job, report_job(names)],
            # the sensor's job (merge_checkpoint) and the schedule's (publish_to_hub) come with them; report_merged_step
            # (step_report from the UI) with the report's automation
            sensors=[
                checkpoint_sensor(names, interval, self.max_concurrent_merges),
                step_report_automation(names, interval),
                failure_webhook(names),
                *promote_best,
            ],
            schedules=[publish_latest_steps],
            resources={
                names("settings"): self.settings(),
                names("hub"): hub,
                names("alert_webhook"): AlertWebhook(alert_webhook_url=self.alert_webhook_url),
            },
        )
        if self.averaging is None:
            return merge
        averaging = dg.Definitions(
            assets=[
                averaged_model_definition(names, self.averaging, merge_config),
                # its Hub upload (materialized from the UI, or by its schedule)
                *([hub_averaged_definition(names)] if hub.enabled else []),
            ],
            sensors=[averaged_model_sensor_definition(names, interval, self.averaging, self.max_concurrent_merges)],
            # hub_averaged_model's schedule, with it: on by default where Hub publishing is configured
            schedules=[publish_averaged_schedule(names, self.hub.schedule)] if hub.enabled else [],
        )
        return dg.Definitions.merge(merge, averaging)

    def settings(self) -> MergeSettings:
        return MergeSettings(**{s.name: getattr(self, s.name) for s in of_resource("settings")})
