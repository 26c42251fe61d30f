"""Watching checkpoint roots, without Dagster: which step folders exist and are complete (``discovery``),
the partition key of each (``partitions``), what the sensor is done with (``cursor``), the names the
merge step, its report and the Hub share (``keys``), and the code location's settings
(``location_settings``). ``merge_pipeline.dagster`` turns these into sensors, assets and resources.
"""
