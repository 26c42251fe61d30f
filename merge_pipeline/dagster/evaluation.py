"""``evaluation``: the user's evaluation of a merged step, run through Dagster Pipes, its metrics recorded.

Downstream of ``hf_model``, partitioned as it is, launched by ``evaluate_merged_step`` (the UI's
"Materialize" on a partition). The command (``evaluation_command``; none: ``smoke_evaluation``, the smoke
test's loss on CPU) runs in a subprocess through ``PipesSubprocessClient`` and reports its metrics as
materialization metadata; they are recorded on this asset, and in the folder's ``merge_manifest.json``
(``hf.evaluation_result``), from which the model card's ``model-index`` is written when the step is published.
Another Pipes client (Kubernetes, Databricks, a GPU host reached over SSH) runs the same command elsewhere:
docs/DAGSTER.md, "The evaluation".

With ``evaluation_threshold`` set, a blocking check ``threshold`` fails a step whose metric misses it; the
Hub's schedule then passes it over (``evaluation_passed``).
"""

import shlex
import sys
import warnings

import dagster as dg

from merge_pipeline.dagster.failures import one_line_failure
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.records import latest_materialization
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.hf.evaluation_result import Threshold
from merge_pipeline.hf.manifest import MANIFEST, read_manifest
from merge_pipeline.store.listing import in_store
from merge_pipeline.watch.keys import GROUP, HEAVY_TAG, OWNERS, THRESHOLD_MET
from merge_pipeline.watch.location_settings import EVALUATION_COMMAND
from merge_pipeline.watch.partitions import checkpoint_key

DEFAULT_COMMAND = f"{shlex.quote(sys.executable)} -m merge_pipeline.dagster.smoke_evaluation"
THRESHOLD_CHECK = "threshold"


def evaluation_definitions(
    names: Names, threshold: Threshold | None
) -> "tuple[dg.AssetsDefinition, dg.UnresolvedAssetJobDefinition]":  # the job class: only in dagster's type stubs
    """The asset (with its blocking check where a threshold is set) and its job."""
    with warnings.catch_warnings():  # partitioned checks are a preview in Dagster 1.13
        warnings.simplefilter("ignore", dg.PreviewWarning)
        checks = (
            [
                dg.AssetCheckSpec(
                    THRESHOLD_CHECK,
                    asset=names.key("evaluation"),
                    blocking=True,
                    partitions_def=names.partitions,
                    description=f"the evaluation's {threshold}\n\nA step that misses it is not published to the Hub.",
                )
            ]
            if threshold
            else []
        )

    @dg.asset(
        key=names.key("evaluation"),
        partitions_def=names.partitions,
        group_name=names(GROUP),
        owners=OWNERS,
        deps=[names.key("hf_model")],
        kinds={"python"},
        tags={"stage": "evaluation"},
        check_specs=checks,
        required_resource_keys={names("settings")},
    )
    def evaluation(context: dg.AssetExecutionContext):
        """The user's evaluation of the published folder, via Pipes.

        Its command run through Dagster Pipes; its metrics as metadata, in the folder's manifest and in the model card's model-index."""
        settings: MergeSettings = getattr(context.resources, names("settings"))
        return _evaluate(context, settings, threshold)

    job = dg.define_asset_job(
        names("evaluate_merged_step"),
        selection=dg.AssetSelection.assets(names.key("evaluation")),
        tags={HEAVY_TAG: "report"},  # the default loads the whole model: not beside a merge
        executor_def=dg.in_process_executor,
        description="Evaluate one merged step.\n\nRuns the evaluation command through Dagster Pipes on the published folder.",
    )
    return evaluation, job


def _evaluate(context: dg.AssetExecutionContext, settings: MergeSettings, threshold: Threshold | None):
    from merge_pipeline.pipeline.folder import record_evaluation  # torch: imported by the run, not the location's load

    key = checkpoint_key(context.partition_key)
    folder = settings.target_dir(key)
    command = settings.value(EVALUATION_COMMAND) or DEFAULT_COMMAND
    with one_line_failure():
        if in_store(folder):  # the command reads files: a store's folder would need a download first
            raise MergeError(None, f"{folder}: the evaluation reads local folders only; merge to a local output_root")
        if not (folder / MANIFEST).is_file():
            raise MergeError(folder, "not a published merged folder: materialize hf_model for this partition first")
        evaluated = read_manifest(folder)
        argv = [a.replace("{folder}", str(folder)) for a in shlex.split(command)]
        context.log.info("evaluating %s: %s", folder, shlex.join(argv))
        try:
            reported = (
                dg.PipesSubprocessClient()
                .run(context=context, command=argv, extras={"folder": str(folder)})
                .get_materialize_result()
            )
        # a non-zero exit (Dagster's DagsterPipesExecutionError, exported nowhere public), a command not found
        except Exception as exc:  # noqa: BLE001
            raise MergeError(
                None, f"the evaluation command failed ({first_line(exc)}); its output is in the run's logs"
            ) from None
        metrics = _metrics(reported.metadata or {})
        if not metrics:
            raise MergeError(None, f"the evaluation command reported no number: {shlex.join(argv)}")
        record_evaluation(folder, command, metrics, evaluated)
    problem = threshold.problem(metrics) if threshold else None
    return dg.MaterializeResult(
        metadata={
            **{name: dg.MetadataValue.float(value) for name, value in metrics.items()},
            "command": dg.MetadataValue.text(command),
            "path": dg.MetadataValue.path(str(folder)),
            **({THRESHOLD_MET: problem is None} if threshold else {}),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name=THRESHOLD_CHECK,
                passed=problem is None,
                description=problem or f"{threshold} met",
            )
        ]
        if threshold
        else [],
    )


def _metrics(metadata: dict) -> dict[str, float]:
    """The numbers the command reported (its other metadata, text or links, stays out of the model card)."""
    found = {}
    for name, entry in metadata.items():
        value = getattr(entry, "value", entry)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = float(value)
    return found


def evaluation_passed(instance: dg.DagsterInstance, names: Names, partition: str, after_storage_id: int) -> bool | None:
    """Whether the partition's evaluation newer than a merge met the threshold; None: none ran since."""
    evaluated = latest_materialization(instance, names.key("evaluation"), partition)
    if evaluated is None or evaluated.storage_id < after_storage_id:
        return None
    met = evaluated.asset_materialization.metadata.get(THRESHOLD_MET)
    return bool(met and met.value)
