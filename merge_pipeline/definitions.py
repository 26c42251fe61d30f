"""The code location (``dagster dev``, ``dg dev``): every module of ``defs/``, merged.

Every job of the location, the implicit one behind the UI's "Materialize" button and backfills
included, runs in one process (``in_process_executor``): a merge step in a fresh process would spend
most of its time importing torch and transformers again.
"""

import dagster as dg

from merge_pipeline.defs import alerts, assets, hub, jobs, report, resources, sensors

defs = dg.Definitions.merge(
    assets.defs,
    report.defs,
    jobs.defs,
    resources.defs,
    sensors.defs,
    hub.defs,
    alerts.defs,
    dg.Definitions(executor=dg.in_process_executor),
)
