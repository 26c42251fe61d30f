"""The Dagster code location (``dagster dev -w workspace.yaml``): every module of ``defs/``, merged."""

import dagster as dg

from merge_pipeline.defs import assets, checks, hub, jobs, resources, sensors

defs = dg.Definitions.merge(assets.defs, checks.defs, jobs.defs, resources.defs, sensors.defs, hub.defs)
