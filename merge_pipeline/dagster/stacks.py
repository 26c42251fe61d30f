"""The training stacks, as a person reads them in the UI: from the readers' step-folder declarations
(``pipeline.step_folders``), never a hand-kept list (one went stale: the sensor's description left out
Megatron-LM's ``iter_<N>``).

The readers import torch, and loading the code location must not (each run worker loads it before the
run starts): the definitions' descriptions name no stack, and what the readers say is shown where a
tick or a run has them loaded already, on the ``checkpoint`` events the sensor records.
"""

from __future__ import annotations

from merge_pipeline.dagster.partitions import CheckpointKey


def stack_of(key: CheckpointKey) -> str:
    """Who writes such a step folder (``verl``, ``Megatron-LM``, ...), as its reader declares it."""
    from merge_pipeline.pipeline import step_folder

    found = step_folder(key.step_dir)
    return found[0].stack if found else "unknown"
