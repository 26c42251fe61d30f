"""``step_report``: did training change anything? The published folder against the previous merged step and the base model.

Downstream of ``hf_model``, in the same run (the merge job selects it): it reads the published folder
and the references one tensor at a time (``hf/step_diff.py``, the same table as ``merge-pipeline
diff``), so its memory is bounded by the largest tensor. Its two checks are not blocking: the folder
is already published and correct as a merge; they flag what training did to it.
"""

import base64
import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg

from merge_pipeline.defs.assets import GROUP, OWNERS, hf_model
from merge_pipeline.defs.failures import one_line_failure
from merge_pipeline.defs.partitions import CheckpointKey, checkpoint_partitions
from merge_pipeline.defs.resources import MergeSettings
from merge_pipeline.hf.manifest import read_manifest

if TYPE_CHECKING:  # torch: imported by the run, not by the code location's load
    from merge_pipeline.hf.step_diff import StepDiff

STEP_REPORT = dg.AssetKey("step_report")
PREVIOUS, BASE = "previous step", "base model"

with warnings.catch_warnings():  # partitioned checks are a preview in Dagster 1.13
    warnings.simplefilter("ignore", dg.PreviewWarning)
    REPORT_CHECKS = [
        dg.AssetCheckSpec(
            "weights_changed",
            asset=STEP_REPORT,
            partitions_def=checkpoint_partitions,
            description="the merged weights differ from the base model's and the previous step's: bit-identical means LoRA was never folded, or training changed nothing",
        ),
        dg.AssetCheckSpec(
            "finite",
            asset=STEP_REPORT,
            partitions_def=checkpoint_partitions,
            description="no NaN or Inf in any merged tensor",
        ),
    ]


@dg.asset(
    partitions_def=checkpoint_partitions,
    group_name=GROUP,
    owners=OWNERS,
    deps=[hf_model],
    kinds={"pytorch"},
    tags={"stage": "report"},
    check_specs=REPORT_CHECKS,
)
def step_report(context: dg.AssetExecutionContext, settings: MergeSettings) -> dg.MaterializeResult:
    """Per tensor: relative change against the previous merged step of the run and the base model, norms, NaN / Inf."""
    from merge_pipeline.hf.step_diff import diff_folders, markdown_table, summary_lines

    key = CheckpointKey.parse(context.partition_key)
    folder = settings.target_dir(key)
    with one_line_failure():
        references = _references(context.instance, settings, key, folder)
        diff = diff_folders(folder, references)
    summary = summary_lines(diff)
    identical = [label for label in diff.references if diff.identical_to(label)]
    return dg.MaterializeResult(
        metadata={
            "path": dg.MetadataValue.path(str(folder)),
            "summary": dg.MetadataValue.md("\n".join(f"- {line}" for line in summary)),
            **{label: dg.MetadataValue.path(str(path)) for label, path in references.items()},
            **{f"largest change vs {label}": diff.max_change(label) for label in diff.references},
            "tensors": len(diff.tensors),
            "NaN": diff.nan,
            "Inf": diff.inf,
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
                check_name="finite", passed=diff.nan + diff.inf == 0, metadata={"NaN": diff.nan, "Inf": diff.inf}
            ),
        ],
    )


def _references(instance: dg.DagsterInstance, settings: MergeSettings, key: CheckpointKey, folder: Path) -> dict:
    """The previous merged step of the same run and role, and the base model when it has weights."""
    from merge_pipeline.hf.folder_checks import weight_files

    found = {}
    earlier = [
        k
        for k in map(CheckpointKey.parse, instance.get_dynamic_partitions(checkpoint_partitions.name))
        if (k.run_name, k.role) == (key.run_name, key.role)
        and k.step < key.step
        and weight_files(settings.target_dir(k))
    ]
    if earlier:
        found[PREVIOUS] = settings.target_dir(max(earlier, key=lambda k: k.step))
    base = read_manifest(folder)["options"].get("hf_model_path") or settings.base_model_dir
    if base and weight_files(Path(base)):  # a base folder with only config and tokenizer has nothing to compare
        found[BASE] = Path(base)
    return found


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


defs = dg.Definitions(assets=[step_report])
