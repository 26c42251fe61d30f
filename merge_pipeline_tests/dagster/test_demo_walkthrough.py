"""The first ten minutes, as a new user has them: ``scripts/demo.sh --once`` in a clean copy of the project,
then every command block the README and docs/DAGSTER.md mark "after scripts/demo.sh", as written and
in order, in one shell: each must work, with no warning from ``dg``."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT
from merge_pipeline_tests.dagster.services import VENV_BIN, clean_copy, free_port

pytestmark = pytest.mark.e2e

MARKER = "# after scripts/demo.sh"
BLOCK = re.compile(r"^```bash\n(" + re.escape(MARKER) + r".*?)^```", re.M | re.S)


def documented_commands() -> str:
    blocks = [b for doc in ("README.md", "docs/DAGSTER.md") for b in BLOCK.findall((PROJECT_ROOT / doc).read_text())]
    assert len(blocks) >= 3, blocks
    return "\n".join(blocks)


def test_every_documented_command_works_after_the_demo(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    clean_copy(project)
    (project / ".venv").symlink_to(VENV_BIN.parent)  # what scripts/setup.sh made; MERGE_PIPELINE_SKIP_SETUP skips it
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MERGE_PIPELINE_", "DAGSTER_", "VIRTUAL_ENV"))}
    env |= {"PYTHONPATH": str(project), "HOME": str(tmp_path), "DAGSTER_PORT": str(free_port())}
    demo = subprocess.run(
        ["bash", "scripts/demo.sh", "--once"],
        cwd=project,
        # the demo's settle time (20 s) guards a checkpoint still being written; its own is complete when the sensor looks
        env=env | {"MERGE_PIPELINE_SKIP_SETUP": "1", "MERGE_PIPELINE_SETTLE_SECONDS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    # its last lines say how to reach the commands and the instance, and which step to drop next
    assert f"cd {project} && source .venv/bin/activate && export DAGSTER_HOME={project}/.dagster_home" in demo.stdout
    assert "global_step_2/actor --trained-steps 1 && printf 2 >" in demo.stdout

    walk = subprocess.run(
        ["bash", "-c", "set -eo pipefail\n" + documented_commands()],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = walk.stdout + walk.stderr
    assert walk.returncode == 0, output[-5000:]
    assert "virtual environment does not match" not in output and "Traceback" not in output, output[-5000:]
    merged = project / "demo" / "merged" / "demo_run" / "global_step_1" / "actor"
    assert (
        json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"
    )  # the documented `dg launch` re-merge
    assert (project / "demo" / "checkpoints" / "demo_run" / "global_step_2" / "actor").is_dir()
