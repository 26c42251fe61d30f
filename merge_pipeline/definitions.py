"""The code location (``dagster dev -w workspace.yaml``, ``dg dev``, ``dagster code-server start -m
merge_pipeline.definitions``): this project's definitions folder (``defs/``, ``[tool.dg.project]
defs_module``), loaded as a dg project loads its own, which instantiates the ``MergeCheckpoints``
component with no prefix and its settings from the environment (``defs/merge/defs.yaml``).

``dg.load_from_defs_folder`` builds the same tree but finds the folder through ``pyproject.toml``,
which an installed wheel does not have: the tree is named here, rooted at the package's parent.

Every job of the location, the implicit one behind the UI's "Materialize" button and backfills
included, runs in one process (``in_process_executor``): a merge step in a fresh process would spend
most of its time importing torch and transformers again.
"""

import warnings
from pathlib import Path

import dagster as dg

import merge_pipeline.defs


def location() -> dg.Definitions:
    """The location's definitions, built now (its at-load settings read from the environment now)."""
    with warnings.catch_warnings():  # the component loader's own beta notes, silenced as load_from_defs_folder does
        warnings.simplefilter("ignore", dg.BetaWarning)
        warnings.simplefilter("ignore", dg.PreviewWarning)
        tree = dg.ComponentTree.from_module(defs_module=merge_pipeline.defs, project_root=Path(__file__).parents[1])
        return dg.Definitions.merge(tree.build_defs(), dg.Definitions(executor=dg.in_process_executor))


defs = location()
