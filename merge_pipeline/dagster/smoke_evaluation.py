"""The evaluation run when the component names no command: the smoke test's loss on a fixed text, on CPU.

Run by the ``evaluation`` asset through Dagster Pipes, as any user's command is
(``python -m merge_pipeline.dagster.smoke_evaluation``): it reads the merged folder from the Pipes extras
and reports the loss as materialization metadata, the way a user's script reports its metrics.
"""

from __future__ import annotations

from pathlib import Path

from merge_pipeline.hf.smoke_test import DEFAULT_PROMPT, smoke_test
from merge_pipeline.watch.keys import SMOKE_LOSS


def main() -> int:
    from dagster_pipes import open_dagster_pipes

    with open_dagster_pipes() as pipes:
        folder = Path(pipes.get_extra("folder"))
        result = smoke_test(folder, DEFAULT_PROMPT)
        pipes.log.info(f"{folder}: loss {result.loss:.4f} on the fixed text in {result.seconds:.1f} s")
        pipes.report_asset_materialization(metadata={SMOKE_LOSS: {"raw_value": result.loss, "type": "float"}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
