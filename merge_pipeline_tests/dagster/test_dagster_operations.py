"""Operations: the run-failure webhook over a real failed run, and settings read at run time."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading

import dagster as dg

from merge_pipeline.dagster.alerts import AlertWebhook
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.watch.location_settings import CHECKPOINT_ROOTS, OUTPUT_ROOT, SETTLE_SECONDS
from merge_pipeline_tests.dagster.helpers import ACTOR, LOCATION, materialize

KEY = "run/global_step_2/actor"
merge_failure_webhook = LOCATION.resolve_sensor_def("merge_failure_webhook")


@contextlib.contextmanager
def webhook_receiver():
    """A real HTTP endpoint on 127.0.0.1 that keeps every JSON body posted to it."""
    received = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hook", received
    finally:
        server.shutdown()
        server.server_close()  # closed: a later post is refused at once
        thread.join()


def failure_context(instance, result, webhook: AlertWebhook) -> dg.RunFailureSensorContext:
    run = instance.get_run_by_id(result.run_id)
    [run_failure] = [e for e in result.all_events if e.event_type_value == "PIPELINE_FAILURE"]
    return dg.build_run_status_sensor_context(
        sensor_name="merge_failure_webhook",
        dagster_event=run_failure,
        dagster_instance=instance,
        dagster_run=run,
        resources={"alert_webhook": webhook},
    ).for_run_failure()


def test_a_failed_run_is_posted_to_the_webhook(fsdp_checkpoint, roots, instance, monkeypatch):
    role_dir = roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2")
    rank_file = role_dir / "model_world_size_2_rank_1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    roots.track(role_dir, 2)
    result = materialize(instance, roots.settings(), KEY)
    assert not result.success

    with webhook_receiver() as (url, received):
        monkeypatch.setenv("MERGE_PIPELINE_ALERT_WEBHOOK_URL", url)  # read when the sensor runs, not at import
        merge_failure_webhook(failure_context(instance, result, AlertWebhook()))

    [body] = received
    error = f"{rank_file}: not a readable zip archive, truncated or corrupt (File is not a zip file)"
    assert body == {
        "text": f"merge_pipeline: run {result.run_id[:8]} of __ephemeral_asset_job__ for {KEY} failed: {error}",
        "run_id": result.run_id,
        "job": "__ephemeral_asset_job__",
        "partition": KEY,
        "failed_steps": ["hf_model"],
        "error": error,
    }


def test_no_webhook_no_alert_and_a_webhook_that_is_down_fails_nothing(fsdp_checkpoint, roots, instance, monkeypatch):
    result = materialize(instance, roots.settings(), "run/global_step_9/actor")  # no such checkpoint
    monkeypatch.delenv("MERGE_PIPELINE_ALERT_WEBHOOK_URL", raising=False)

    skipped = merge_failure_webhook(failure_context(instance, result, AlertWebhook()))

    assert isinstance(skipped, dg.SkipReason) and "MERGE_PIPELINE_ALERT_WEBHOOK_URL is not set" in skipped.skip_message
    with webhook_receiver() as (url, _):
        down = url  # the receiver is stopped once the block ends
    assert merge_failure_webhook(failure_context(instance, result, AlertWebhook(alert_webhook_url=down))) is None


def test_settings_are_read_from_the_environment_when_used(tmp_path, monkeypatch):
    settings = MergeSettings()  # as definitions.py builds it, when the location loads
    monkeypatch.setenv("MERGE_PIPELINE_CHECKPOINT_ROOTS", f"{tmp_path / 'a'}:{tmp_path / 'b'}")
    monkeypatch.setenv("MERGE_PIPELINE_OUTPUT_ROOT", str(tmp_path / "merged"))
    monkeypatch.setenv("MERGE_PIPELINE_SETTLE_SECONDS", "5")

    assert [settings.value(s) for s in (CHECKPOINT_ROOTS, OUTPUT_ROOT, SETTLE_SECONDS)] == [
        [tmp_path / "a", tmp_path / "b"],
        tmp_path / "merged",
        5.0,
    ]
