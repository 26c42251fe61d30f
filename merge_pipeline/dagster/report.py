"""``step_report``: did training change anything? The published folder against the previous merged step and the base model.

Downstream of ``hf_model``, in a run of its own that its automation condition requests after each successful
merge (``report_automation.py``) (a merge run that failed would otherwise show these checks "Execution failed"): it reads the published folder
and the references one tensor at a time (``hf/step_diff.py``, the same table as ``merge-pipeline
diff``), so its memory is bounded by the largest tensor. Its two checks are not blocking: the folder
is already published and correct as a merge; they flag what training did to it.
"""

import base64
import contextlib
import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.dagster.failures import one_line_failure
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.report_automation import step_report_condition
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.errors import first_line
from merge_pipeline.hf.file_names import WEIGHT_SUFFIXES
from merge_pipeline.hf.manifest import read_manifest
from merge_pipeline.hf.smoke_test import NEW_TOKENS, generates_text, smoke_test
from merge_pipeline.hub.model_card import quantization_rows
from merge_pipeline.progress import human_bytes
from merge_pipeline.store.listing import Folder, in_store, on_disk
from merge_pipeline.store.view import viewed
from merge_pipeline.watch.keys import GROUP, INF, NAN, OWNERS, SMOKE, SMOKE_LOSS, SMOKE_PROMPT, SMOKE_TEXT
from merge_pipeline.watch.location_settings import HF_MODEL_PATH, SMOKE_MAX_SIZE, SMOKE_TEST, SMOKE_TEST_PROMPT
from merge_pipeline.watch.partitions import checkpoint_key

if TYPE_CHECKING:  # torch: imported by the run, not by the code location's load
    from merge_pipeline.hf.step_diff import StepDiff

PREVIOUS, BASE = "previous step", "base model"
# the smoke test's metadata entries; hub_model copies them into the model card


def report_checks(names: Names) -> list[dg.AssetCheckSpec]:
    with warnings.catch_warnings():  # partitioned checks are a preview in Dagster 1.13
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return [
            dg.AssetCheckSpec(
                "weights_changed",
                asset=names.key("step_report"),
                partitions_def=names.partitions,
                description="the weights differ from the base's and previous step's\n\nBit-identical means LoRA was never folded, or training changed nothing.",
            ),
            dg.AssetCheckSpec(
                "finite",
                asset=names.key("step_report"),
                partitions_def=names.partitions,
                description="no NaN or Inf in any merged tensor",
            ),
        ]


def step_report_definition(names: Names, max_concurrent_merges: int) -> dg.AssetsDefinition:
    @dg.asset(
        key=names.key("step_report"),
        partitions_def=names.partitions,
        group_name=names(GROUP),
        owners=OWNERS,
        deps=[names.key("hf_model")],
        kinds={"pytorch"},
        tags={"stage": "report"},
        check_specs=report_checks(names),
        required_resource_keys={names("settings")},
        automation_condition=step_report_condition(names, max_concurrent_merges),
    )
    def step_report(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        """Per tensor: change against the previous step and the base.

        Relative change against the previous merged step of the run and the base model, norms, NaN / Inf.
        """
        return _report(context, getattr(context.resources, names("settings")), names)

    return step_report


def _report(context: dg.AssetExecutionContext, settings: MergeSettings, names: Names) -> dg.MaterializeResult:
    from merge_pipeline.hf.step_diff import diff_folders, markdown_table, summary_lines  # torch: by the run only

    key = checkpoint_key(context.partition_key)
    folder = settings.target_dir(key)
    with one_line_failure(), contextlib.ExitStack() as views:
        # a merged folder in a store, and the previous step's there, read through views (tensors by ranged GETs)
        local = views.enter_context(viewed(folder, WEIGHT_SUFFIXES, merged=True))
        references = _references(context.instance, settings, key, local, names)
        diff = diff_folders(
            local,
            {label: views.enter_context(viewed(p, WEIGHT_SUFFIXES, merged=True)) for label, p in references.items()},
        )
        quantized = quantization_rows(read_manifest(local)["decisions"].get("quantization"))
    summary = summary_lines(diff)
    identical = [label for label in diff.references if diff.identical_to(label)]
    smoke = _smoke_metadata(context, settings, folder) if settings.value(SMOKE_TEST) else {}
    return dg.MaterializeResult(
        metadata={
            **smoke,
            "path": dg.MetadataValue.path(str(folder)),
            **(
                {"quantization": dg.MetadataValue.md("\n".join(f"- {k}: {v}" for k, v in quantized))}
                if quantized
                else {}
            ),
            "summary": dg.MetadataValue.md("\n".join(f"- {line}" for line in summary)),
            **{label: dg.MetadataValue.path(str(path)) for label, path in references.items()},
            **{f"largest change vs {label}": diff.max_change(label) for label in diff.references},
            "tensors": len(diff.tensors),
            NAN: diff.nan,
            INF: diff.inf,
            "table": dg.MetadataValue.md(markdown_table(diff)),
            "plot": dg.MetadataValue.md(f"![relative change by layer](data:image/png;base64,{_plot_png(diff)})"),
        },
        check_results=[
            dg.AssetCheckResult(
                check_name="weights_changed",
                passed=not identical,
                metadata={
                    "compared with": ", ".join(diff.references) or "nothing (no previous step, no base model weights)",
                    "bit-identical to": ", ".join(identical) or "none",
                },
            ),
            dg.AssetCheckResult(
                check_name="finite", passed=diff.nan + diff.inf == 0, metadata={NAN: diff.nan, INF: diff.inf}
            ),
        ],
    )


def _references(
    instance: dg.DagsterInstance, settings: MergeSettings, key: CheckpointName, folder: Path, names: Names
) -> dict:
    """The previous merged step of the same run and role, and the base model when it has weights."""
    from merge_pipeline.hf.folder_checks import weight_files  # torch: by the run only

    found = {}
    earlier = [
        k
        for k in map(checkpoint_key, instance.get_dynamic_partitions(names.partitions.name))
        if (k.run, k.role) == (key.run, key.role) and k.step < key.step and _has_weights(settings.target_dir(k))
    ]
    if earlier:
        found[PREVIOUS] = settings.target_dir(max(earlier, key=lambda k: k.step))
    base = read_manifest(folder)["options"].get("hf_model_path") or settings.value(HF_MODEL_PATH)
    # a base folder with only config and tokenizer has nothing to compare; one in a store is not compared
    if base and (local := on_disk(base)) and weight_files(local):
        found[BASE] = local
    return found


def _has_weights(folder: Folder) -> bool:
    """A merged step to compare with: its weights on disk, or its commit marker in a store."""
    from merge_pipeline.hf.folder_checks import weight_files  # torch: by the run only

    store = in_store(folder)
    return store.published() if store else bool(weight_files(folder))


def _smoke_metadata(context: dg.AssetExecutionContext, settings: MergeSettings, folder: Path) -> dict:
    """The smoke test's prompt, greedy text and loss on the fixed text (what the model card shows), or why
    it did not run. A folder that fails it stays published: it passed the blocking checks; this says it
    does not run, in the report."""
    if on_disk(folder) is None:
        return {SMOKE: "skipped: the merged folder is in a store (the smoke test loads a folder on local disk)"}
    manifest = read_manifest(folder)
    weight_bytes = sum(f["size"] for n, f in manifest["files"].items() if n.endswith(".safetensors"))
    if weight_bytes > settings.value(SMOKE_MAX_SIZE):
        why = f"{human_bytes(weight_bytes)} of weights is over smoke_max_size ({human_bytes(settings.value(SMOKE_MAX_SIZE))})"
    else:
        why = generates_text(folder)
    if why:
        return {SMOKE: f"skipped: {why}"}
    try:
        smoke = smoke_test(
            folder, settings.value(SMOKE_TEST_PROMPT), trust_remote_code=manifest["options"]["trust_remote_code"]
        )
    except Exception as exc:  # whatever transformers raises: the report says it, the merge stays good
        context.log.warning(f"{folder}: smoke test failed: {first_line(exc)}")
        return {SMOKE: f"failed: {first_line(exc)}"}
    return {
        SMOKE: f"passed: {NEW_TOKENS} greedy tokens on CPU in {smoke.seconds:.1f} s",
        SMOKE_PROMPT: dg.MetadataValue.text(smoke.prompt),
        SMOKE_TEXT: dg.MetadataValue.text(smoke.text),
        SMOKE_LOSS: round(smoke.loss, 4),
    }


def _plot_png(diff: "StepDiff") -> str:
    """Relative change by layer, one line per tensor kind and reference, as a base64 PNG for the UI."""
    import matplotlib

    matplotlib.use("Agg")  # no display in a run worker
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4), dpi=80)
    try:
        for label in diff.references:
            lines: dict[str, list[tuple[int, float]]] = {}
            for t in diff.tensors:
                change = t.relative_change[label]
                if t.layer is not None and change:  # log scale: an unchanged tensor has no point
                    lines.setdefault(t.kind.rsplit("layers.", 1)[-1], []).append((t.layer, change))
            for kind, points in sorted(lines.items()):
                layers, changes = zip(*sorted(points), strict=True)
                axes.plot(layers, changes, marker="o", label=f"{kind} vs {label}")
        axes.set(xlabel="layer", ylabel="relative change", title="||new - ref|| / ||ref|| per tensor")
        if axes.lines:
            axes.set_yscale("log")
            axes.legend(fontsize=6, ncol=2)
        else:
            axes.text(0.5, 0.5, "no layer changed (or nothing to compare)", ha="center", transform=axes.transAxes)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
    finally:
        plt.close(figure)
    return base64.b64encode(buffer.getvalue()).decode()
