"""The code location (``dagster dev -w workspace.yaml``, ``dg dev``): this project's definitions folder
(``defs/``, loaded as any dg project loads its own), which instantiates the ``MergeCheckpoints`` component
with no prefix and its settings from the environment (``defs/merge/defs.yaml``).

Every job of the location, the implicit one behind the UI's "Materialize" button and backfills
included, runs in one process (``in_process_executor``): a merge step in a fresh process would spend
most of its time importing torch and transformers again.
"""

from pathlib import Path

import dagster as dg

defs = dg.Definitions.merge(
    dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
    dg.Definitions(executor=dg.in_process_executor),
)
