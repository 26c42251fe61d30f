"""``merge_failure_webhook``: a failed run posts one JSON message to ``$MERGE_PIPELINE_ALERT_WEBHOOK_URL``.

Unset (the default), the sensor does nothing. The body carries ``text`` (read by Slack and Mattermost
incoming webhooks) and the fields a script would want. Posting is best effort: a webhook that is
down is logged, and never fails or retries anything.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import dagster as dg

from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.watch.location_settings import ALERT_WEBHOOK_URL, of_resource, with_fields

TIMEOUT_SECONDS = 10


class AlertWebhook(with_fields(dg.ConfigurableResource, of_resource("alert_webhook"))):
    @property
    def target(self) -> str | None:
        return ALERT_WEBHOOK_URL.value(self.alert_webhook_url)

    def post(self, body: dict) -> None:
        request = urllib.request.Request(
            self.target, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS):
            pass


def failure_message(context: dg.RunFailureSensorContext) -> dict:
    run = context.dagster_run
    steps = [
        f"{e.step_key}: {e.event_specific_data.error_display_string.strip()}"
        if e.event_specific_data and e.event_specific_data.error
        else e.step_key
        for e in context.get_step_failure_events()
    ]
    descriptions = [
        e.step_failure_data.user_failure_data.description
        for e in context.get_step_failure_events()
        if e.step_failure_data.user_failure_data
    ]
    partition = run.tags.get("dagster/partition")
    why = descriptions[0] if descriptions else (steps[0] if steps else context.failure_event.message)
    return {
        "text": f"merge_pipeline: run {run.run_id[:8]} of {run.job_name}{f' for {partition}' if partition else ''} failed: {why}",
        "run_id": run.run_id,
        "job": run.job_name,
        "partition": partition,
        "failed_steps": [e.step_key for e in context.get_step_failure_events()],
        "error": why,
    }


def failure_webhook(names: Names) -> dg.SensorDefinition:
    def merge_failure_webhook(context: dg.RunStatusSensorContext, **_called_with: object) -> dg.SkipReason | None:
        # (called directly, Dagster passes the resources as arguments too; the daemon does not)
        context = context.for_run_failure()
        alert_webhook: AlertWebhook = getattr(context.resources, names("alert_webhook"))
        if not _of_this_instance(context.dagster_run, names):
            return dg.SkipReason(f"run {context.dagster_run.run_id[:8]} is another instance's")
        if not alert_webhook.target:
            return dg.SkipReason(f"{ALERT_WEBHOOK_URL.variable} is not set: no alert sent")
        try:
            alert_webhook.post(failure_message(context))
        except (OSError, urllib.error.URLError) as exc:
            context.log.warning(f"alert webhook not reached: {exc}")
        return None

    # (run_failure_sensor's decorator takes resources only as parameters named after their keys)
    return dg.RunStatusSensorDefinition(
        name=names("merge_failure_webhook"),
        run_status=dg.DagsterRunStatus.FAILURE,
        run_status_sensor_fn=merge_failure_webhook,
        default_status=dg.DefaultSensorStatus.RUNNING,  # inert until MERGE_PIPELINE_ALERT_WEBHOOK_URL is set
        required_resource_keys={names("alert_webhook")},
        description=f"Posts each failed run to a webhook.\n\nTo ${ALERT_WEBHOOK_URL.variable}; off when unset.",
    )


def _of_this_instance(run: dg.DagsterRun, names: Names) -> bool:
    """Several prefixed instances in one project each see every failed run: each posts only its own
    (its jobs, or the UI's asset runs of its assets)."""
    if not names.prefix:
        return True
    return run.job_name.startswith(names("")) or any(k.path[0] == names.prefix for k in run.asset_selection or ())
