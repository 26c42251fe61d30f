"""``dg --help`` and the help of every ``dg`` command the docs name list their commands and options in the
environment this project installs. typer 0.26 vendored its own click, and ``dg``'s help (typer's
``rich_format_help`` on dg's click commands) then showed the usage line only: pinned below 0.26 in
pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT

BIN = Path(sys.executable).parent

# The dg commands docs/DAGSTER.md and the README name, and what each one's help must show.
SHOWN = {
    (): ["check", "dev", "launch", "list", "scaffold", "--version"],
    ("dev",): ["--port", "--host", "--log-level"],
    ("check", "defs"): ["--check-yaml"],
    ("list", "defs"): ["--json"],
    ("launch",): ["--job", "--partition", "--config-json", "--assets"],
    ("scaffold", "defs"): ["merge_pipeline.MergeCheckpoints", "dagster.asset"],
}


@pytest.mark.slow
@pytest.mark.parametrize("command", list(SHOWN), ids=lambda c: " ".join(("dg", *c, "--help")))
def test_dg_help_lists_commands_and_options(command, tmp_path):
    env = os.environ | {
        "PYTHONPATH": str(PROJECT_ROOT),
        "HOME": str(tmp_path),
        "COLUMNS": "200",  # one row per option, whatever the terminal
        "DAGSTER_DISABLE_TELEMETRY": "1",
    }
    shown = subprocess.run(
        [str(BIN / "dg"), *command, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    missing = [word for word in SHOWN[command] if word not in shown.stdout]
    assert not missing, f"dg {' '.join(command)} --help does not show {missing}:\n{shown.stdout}"
