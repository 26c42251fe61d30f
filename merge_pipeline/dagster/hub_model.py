"""Publishing to a Hugging Face Hub: the ``hub`` resource, the ``hub_model`` asset and its schedule, and
``hub_averaged_model`` (with the component's ``averaging:``): a run's averaged model, on a branch of its
role's repo named ``averaged-last-<K>``.

Its settings (organization, private, repo template, revisions, endpoint, timeout, token) are declared
with the merge's in ``settings.py``: the resource's fields, the component's ``hub:`` attributes and their
variables (``MERGE_PIPELINE_HUB_ORG``, ..., ``HF_ENDPOINT``, ``HF_TOKEN``) come from there.
"""

import os
import re
from collections import defaultdict
from pathlib import Path

import dagster as dg

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.dagster.averaged_model import RunKey, averaged_dir, averaged_partitions
from merge_pipeline.dagster.checks import passed_every_check
from merge_pipeline.dagster.evaluation import evaluation_passed
from merge_pipeline.dagster.failures import one_line_failure
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.records import latest_materialization
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.errors import MergeError
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.hf.file_names import WEIGHT_SUFFIXES
from merge_pipeline.hub.upload import UploadResult, upload_folder_verified
from merge_pipeline.progress import human_bytes
from merge_pipeline.settings import HUB_TIMEOUT, Setting, T
from merge_pipeline.store.record import MANIFEST
from merge_pipeline.store.view import viewed
from merge_pipeline.watch.keys import HUB_GROUP, INF, NAN, SMOKE_LOSS, SMOKE_PROMPT, SMOKE_TEXT
from merge_pipeline.watch.location_settings import (
    HUB_ENDPOINT,
    HUB_ORG,
    HUB_PRIVATE,
    HUB_REPO_TEMPLATE,
    HUB_REVISIONS,
    HUB_TOKEN,
    OUTPUT_ROOT,
    of_resource,
    with_fields,
)
from merge_pipeline.watch.partitions import checkpoint_key

# The averaged model's branch in its run's role repo: no trainer names a step folder so (no collision with
# the step branches), and one branch per K, updated in place as steps land (its history: the averages).
AVERAGED_BRANCH = "averaged-last-{k}"


def env_token() -> dg.EnvVar | None:
    """The token's variable as an EnvVar (the UI shows its name, not its value); none: the stored `hf auth login`."""
    return dg.EnvVar(HUB_TOKEN.variable) if HUB_TOKEN.variable in os.environ else None


class HuggingFaceHub(with_fields(dg.ConfigurableResource, of_resource("hub"))):
    """Where and how merged folders are published. A field left unset is read from its variable when
    used (the component sets every one but the token when the location loads)."""

    def value(self, setting: Setting[T]) -> T:
        """``setting``: the field's, else its variable's now, else the default; checked."""
        return setting.value(getattr(self, setting.name))

    @property
    def enabled(self) -> bool:
        return bool(self.value(HUB_ORG))

    def repo_id(self, key: CheckpointName) -> str:
        # A run name may be a path below the watched root ("team/exp1"); a repo name has no "/".
        run_name = re.sub(r"[^\w.-]+", "-", key.run).strip("-.")
        return self.value(HUB_REPO_TEMPLATE).format(
            org=self.value(HUB_ORG), run_name=run_name, role=key.role, step=key.step
        )

    def revision(self, key: CheckpointName) -> str | None:
        """The step's branch, named as its trainer names the step folder (global_step_7, step-10, iter_0000100)."""
        return key.step_folder if self.value(HUB_REVISIONS) == "branch" else None

    def publish(
        self, folder: Path, key: CheckpointName, smoke: dict | None = None, branch: str | None = None
    ) -> UploadResult:
        """``branch``: that branch of the key's repo instead of the step's revision (an averaged model's)."""
        return upload_folder_verified(
            folder,
            self.repo_id(key),
            private=self.value(HUB_PRIVATE),
            revision=branch or self.revision(key),
            endpoint=self.value(HUB_ENDPOINT),
            token=self.value(HUB_TOKEN),
            timeout_s=self.value(HUB_TIMEOUT),
            smoke=smoke,
        )


def hub_definitions(
    names: Names, cron: str, running: bool, gated: bool = False
) -> tuple[dg.AssetsDefinition, dg.ScheduleDefinition]:
    """``hub_model`` and its schedule (with its job); the schedule runs by default only when a Hub
    organization is set when the code location loads (``running``: a schedule's default is fixed then).
    ``gated``: an evaluation threshold is set, and the schedule publishes only steps whose evaluation met it."""

    @dg.asset(
        key=names.key("hub_model"),
        partitions_def=names.partitions,
        group_name=names(HUB_GROUP),
        deps=[names.key("hf_model")],
        kinds={"huggingface"},
        output_required=False,
        required_resource_keys={names("settings"), names("hub")},
    )
    def hub_model(context: dg.AssetExecutionContext):
        """The merged folder on the Hub, with its model card.

        Checked file by file against the manifest after upload.

        Materializes only when a Hub organization is configured; otherwise the step succeeds and records nothing.
        """
        yield from _publish(
            context, getattr(context.resources, names("settings")), getattr(context.resources, names("hub")), names
        )

    publish_job = dg.define_asset_job(
        names("publish_to_hub"),
        selection=[hub_model],
        description="Upload merged checkpoints to the Hub and verify them.",
    )

    @dg.schedule(
        name=names("publish_latest_steps"),
        cron_schedule=cron,
        job=publish_job,
        default_status=dg.DefaultScheduleStatus.RUNNING if running else dg.DefaultScheduleStatus.STOPPED,
        required_resource_keys={names("hub")},
        description="Publishes each run's highest merged step to the Hub.\n\n"
        "The highest merged step of each run (its blocking checks passed before publishing), "
        "once its step report found every tensor finite, once per merge of that step. "
        "Off until MERGE_PIPELINE_HUB_ORG is set (in .env) when the code location loads; then it runs by default.",
    )
    def publish_latest_steps(context: dg.ScheduleEvaluationContext, **_called_with: object):
        # (called directly, Dagster passes the resources as arguments too; the daemon does not)
        return _latest_steps(context, getattr(context.resources, names("hub")), names, gated)

    return hub_model, publish_latest_steps


def _publish(context: dg.AssetExecutionContext, settings: MergeSettings, hub: HuggingFaceHub, names: Names):
    if not hub.enabled:
        context.log.info("no Hub organization configured (MERGE_PIPELINE_HUB_ORG): nothing published")
        return
    with one_line_failure():
        key = checkpoint_key(context.partition_key)
        # A merged folder in a store is published through its view, as the CLI's `upload`: weight files
        # streamed by ranged GETs, and refused while its merge_manifest.json (the commit marker) is missing.
        with viewed(settings.target_dir(key), WEIGHT_SUFFIXES, merged=True) as folder:
            result = hub.publish(folder, key, _smoke_of(context.instance, names, str(key)))
    yield dg.MaterializeResult(metadata=_published(result))


def _published(result: UploadResult) -> dict:
    return {
        "repo": result.repo_id,
        "revision": result.revision,
        "url": dg.MetadataValue.url(result.url),
        "commit_url": dg.MetadataValue.url(result.commit_url),
        "files": result.files,
        "bytes": result.bytes,
        "size": human_bytes(result.bytes),
        "files_sent": len(result.sent),
    }


def hub_averaged_definition(names: Names) -> dg.AssetsDefinition:
    """``hub_averaged_model``: defined by the component only when both averaging and a Hub organization are set."""

    @dg.asset(
        key=names.key("hub_averaged_model"),
        partitions_def=averaged_partitions(names),
        group_name=names(HUB_GROUP),
        deps=[names.key("averaged_model")],
        kinds={"huggingface"},
        required_resource_keys={names("settings"), names("hub")},
    )
    def hub_averaged_model(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        """The run's averaged model on the Hub, with its model card.

        On branch ``averaged-last-<K>`` of its role's repo (the repo its steps go to), the card naming every
        averaged step and its weight, checked file by file after upload."""
        settings: MergeSettings = getattr(context.resources, names("settings"))
        hub: HuggingFaceHub = getattr(context.resources, names("hub"))
        with one_line_failure():
            # an average in a store, through its view as hub_model's folders (refused without its manifest)
            with viewed(
                averaged_dir(settings, RunKey.parse(context.partition_key)), WEIGHT_SUFFIXES, merged=True
            ) as folder:
                inputs = _averaged_inputs(folder)
                result = hub.publish(
                    folder, _newest_step(inputs, settings, folder), branch=AVERAGED_BRANCH.format(k=len(inputs))
                )
        return dg.MaterializeResult(metadata=_published(result))

    return hub_averaged_model


def _averaged_inputs(folder: Path) -> list[dict]:
    """The averaged merged folders its manifest records, oldest first."""
    if not (folder / MANIFEST).is_file():
        raise MergeError(folder, f"has no {MANIFEST}: materialize averaged_model for this run first")
    try:
        inputs = read_json_object(folder / MANIFEST)["source"]["layout"].get("averaged_inputs")
    except (KeyError, TypeError, AttributeError):
        inputs = None
    if not inputs:
        raise MergeError(folder / MANIFEST, "records no averaged inputs: not an averaged model")
    return inputs


def _newest_step(inputs: list[dict], settings: MergeSettings, folder: Path) -> CheckpointName:
    """The newest averaged step's key (its repo is the run's role's; the template's {step} is that step).
    Compared as text: the inputs and the root are URLs in a store (a Path would fold ``s3://`` to ``s3:/``)."""
    newest, root = str(inputs[-1]["path"]), str(settings.value(OUTPUT_ROOT)).rstrip("/")
    if not newest.startswith(root + "/"):
        raise MergeError(folder, f"its newest input {newest} is not a merged step under {root}")
    return checkpoint_key(newest.removeprefix(root + "/"))


def _latest_steps(context: dg.ScheduleEvaluationContext, hub: HuggingFaceHub, names: Names, gated: bool):
    if not hub.enabled:
        return dg.SkipReason("no Hub organization configured (MERGE_PIPELINE_HUB_ORG)")
    instance = context.instance
    runs = _merged_steps_by_run(instance, names)
    requests = []
    for steps in runs.values():
        key, merge = _highest_verified(instance, steps, context.log, names, gated)
        published = latest_materialization(instance, names.key("hub_model"), str(key)) if key else None
        if key and (published is None or published.storage_id < merge.storage_id):
            requests.append(dg.RunRequest(run_key=f"{key}@{merge.storage_id}", partition_key=str(key)))
    return requests or dg.SkipReason(f"nothing new to publish from {len(runs)} merged run(s)")


def _smoke_of(instance: dg.DagsterInstance, names: Names, partition: str) -> dict | None:
    """The smoke test of the partition's latest step report, when it ran (for the model card)."""
    report = latest_materialization(instance, names.key("step_report"), partition)
    metadata = report.asset_materialization.metadata if report else {}
    if SMOKE_LOSS not in metadata:
        return None
    return {
        "prompt": metadata[SMOKE_PROMPT].value,
        "text": metadata[SMOKE_TEXT].value,
        "loss": metadata[SMOKE_LOSS].value,
    }


def _merged_steps_by_run(instance: dg.DagsterInstance, names: Names) -> dict[tuple[str, str], list[CheckpointName]]:
    keys = instance.get_dynamic_partitions(names.partitions.name)
    runs = defaultdict(list)
    for partition, state in (
        instance.get_status_by_partition(names.key("hf_model"), keys, names.partitions) or {}
    ).items():
        if state == dg.AssetPartitionStatus.MATERIALIZED:
            key = checkpoint_key(partition)
            runs[(key.run, key.role)].append(key)
    return runs


def _highest_verified(
    instance: dg.DagsterInstance, steps: list[CheckpointName], log, names: Names, gated: bool
) -> tuple[CheckpointName | None, dg.EventLogRecord | None]:
    """The highest step whose latest merge passed every blocking check (they run before publishing; its
    hf_model metadata lists them) and whose step report of that merge found every tensor finite, with
    that merge's record. While the highest merged step waits for its report, nothing of the run is
    published (not an older step first); a step whose report found NaN or Inf is passed over."""
    for key in sorted(steps, key=lambda k: k.step, reverse=True):
        merge = latest_materialization(instance, names.key("hf_model"), str(key))
        if not passed_every_check(merge.asset_materialization.metadata):
            log.info(f"{key}: not published: recorded as found, not merged and checked by this instance")
            continue
        report = latest_materialization(instance, names.key("step_report"), str(key))
        if report is None or report.storage_id < merge.storage_id:
            log.info(f"{key}: not published yet: no step report of its latest merge")
            return None, None
        metadata = report.asset_materialization.metadata
        if metadata[NAN].value or metadata[INF].value:
            log.info(f"{key}: not published: its step report found NaN or Inf (the finite check failed)")
            continue
        if gated:
            passed = evaluation_passed(instance, names, str(key), merge.storage_id)
            if passed is None:
                log.info(f"{key}: not published yet: no evaluation of its latest merge")
                return None, None
            if not passed:
                log.info(f"{key}: not published: its evaluation missed the threshold")
                continue
        return key, merge
    return None, None
