"""``dg scaffold defs merge_pipeline.MergeCheckpoints <name>``: the component's ``defs.yaml``, naming every
setting with its description, and this package's instance settings in a project that has none."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import click
import dagster as dg

from merge_pipeline.watch.keys import HUB_CRON
from merge_pipeline.watch.location_settings import scaffold_lines

INSTANCE_SETTINGS = Path(__file__).parent / "instance.yaml"


class MergeCheckpointsScaffolder(dg.Scaffolder):
    """``dg scaffold defs merge_pipeline.MergeCheckpoints <name>``: a defs.yaml naming every setting, and
    the instance settings (``dagster.yaml``) in a project root that has none."""

    def scaffold(self, request: dg.ScaffoldRequest) -> None:
        if request.project_root is not None:
            click.echo(_write_instance_settings(request.project_root))
        request.target_path.mkdir(parents=True, exist_ok=True)
        prefix = request.target_path.name.replace("-", "_")
        settings = textwrap.indent("\n".join(scaffold_lines(prefix)), "  ")
        hub = textwrap.indent("\n".join([*scaffold_lines(prefix, "hub"), f'schedule: "{HUB_CRON}"']), "    ")
        (request.target_path / "defs.yaml").write_text(
            f"type: {request.type_name}\nattributes:\n"
            f"  # asset keys {prefix}/..., jobs, sensors and schedules {prefix}__...\n  prefix: {prefix}\n"
            f"{settings}\n{CONCURRENCY}  hub:\n{hub}\n{STRUCTURE}"
        )


# The scaffolded defs.yaml's attributes that are no setting of settings.py (no variable of their own).
CONCURRENCY = """\
  # merge and report runs of this instance at once (its sensors and the report's automation
  # hold back the rest);
  # 0: all, for an instance whose run queue limits them (docs/DAGSTER.md, "The component")
  max_concurrent_merges: 1
"""
STRUCTURE = """\
  # the merge step's config for every run without its own, e.g. weights written by Ray tasks
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
"""


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
