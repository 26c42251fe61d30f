"""The code location (``dagster dev``, ``dg dev``): the ``MergeCheckpoints`` component with no prefix,
its settings from the environment (``dagster/component.py``; another project adds the same component
with ``dg scaffold defs merge_pipeline.MergeCheckpoints <name>``).

Every job of the location, the implicit one behind the UI's "Materialize" button and backfills
included, runs in one process (``in_process_executor``): a merge step in a fresh process would spend
most of its time importing torch and transformers again.
"""

import dagster as dg

from merge_pipeline.dagster.component import MergeCheckpoints
from merge_pipeline.dagster.names import PLAIN

defs = dg.Definitions.merge(
    MergeCheckpoints.from_env().definitions(PLAIN), dg.Definitions(executor=dg.in_process_executor)
)
