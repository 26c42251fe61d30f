"""What a user does (docs/DAGSTER.md, "The component"): a project made by ``create-dagster project``, the CPU
torch first, this package with its [s3] and [ray] extras installed into the project's venv (its Dagster
release and torch unchanged, ``pip check`` clean), the component scaffolded with ``dg`` and pointed at a
bucket holding a real checkpoint, ``dg check defs``, and one merge requested by the component's sensor, bit
for bit the source model. The venv is scripts/setup_user_project.sh's (scripts/test.sh builds it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from merge_pipeline_tests.dagster.helpers import ACTOR, PROJECT_ROOT
from merge_pipeline_tests.dagster.test_dagster_store import KEY, put_step
from merge_pipeline_tests.helpers import assert_bit_exact

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

VENV = PROJECT_ROOT / ".venv-user-project"
# dg as a tool of its own (`uvx dg`): dagster-dg-cli requires the dagster of its own release, which need not
# be the project's; with the project's venv active it loads the project there.
DG = Path(sys.executable).parent / "dg"
TICK = Path(__file__).with_name("user_project_tick.py")
VERSIONS = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name'].lower(): d.version for d in m.distributions()}))"


def run(*command, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def versions(python: Path) -> dict[str, str]:
    listed = run(python, "-c", VERSIONS)
    assert listed.returncode == 0, listed.stderr[-2000:]
    return json.loads(listed.stdout)


def test_a_new_dagster_project_installs_the_package_and_its_sensor_merges_from_a_bucket(
    bucket, fsdp_checkpoint, tmp_path
):
    fs, b = bucket
    python = VENV / "bin" / "python"
    assert python.is_file(), f"{python} missing: run scripts/test.sh (scripts/setup_user_project.sh builds it)"
    made = run(
        VENV / "create-dagster" / "bin" / "create-dagster", "project", "user_project", "--no-uv-sync", cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr[-2000:]
    project = tmp_path / "user_project"
    [pinned] = re.findall(r'"dagster==([^"]+)"', (project / "pyproject.toml").read_text())
    installed = run(python, "-m", "pip", "install", "--quiet", "-e", project)
    assert installed.returncode == 0, installed.stderr[-3000:]
    run(python, "-m", "pip", "uninstall", "--yes", "merge_pipeline")  # left by an earlier run: this code instead
    before = versions(python)
    assert before["dagster"] == pinned and before["torch"].endswith("+cpu")

    installed = run(python, "-m", "pip", "install", f"{PROJECT_ROOT}[s3,ray]")

    # pip reports a conflict it could not avoid as an ERROR line, exiting 0
    assert installed.returncode == 0 and "ERROR" not in installed.stderr, installed.stderr[-3000:]
    after = versions(python)
    assert {name: after.get(name) for name in before} == before  # nothing the project had changes, dagster included
    assert "merge_pipeline" in after and "dagster-dg-cli" not in after and "dagster-webserver" not in after
    checked = run(python, "-m", "pip", "check")
    assert checked.returncode == 0, checked.stdout[-2000:]

    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PYTHONPATH")} | {
        "VIRTUAL_ENV": str(VENV),
        "PATH": os.pathsep.join([str(VENV / "bin"), os.environ["PATH"]]),
        "HOME": str(tmp_path / "home"),
        "DAGSTER_DISABLE_TELEMETRY": "1",
    }
    scaffolded = run(DG, "scaffold", "defs", "merge_pipeline.MergeCheckpoints", "cluster_a", cwd=project, env=env)
    assert scaffolded.returncode == 0, scaffolded.stderr[-3000:]
    defs_yaml = project / "src" / "user_project" / "defs" / "cluster_a" / "defs.yaml"
    component = yaml.safe_load(defs_yaml.read_text())
    component["attributes"].update(
        checkpoint_roots=[f"s3://{b}/ckpts"], output_root=str(tmp_path / "merged"), settle_seconds=3600
    )
    defs_yaml.write_text(yaml.safe_dump(component))
    sample = fsdp_checkpoint(ACTOR)
    put_step(fs, b, sample, KEY, tracker=1)  # the tracker says the step is complete
    checked = run(DG, "check", "defs", cwd=project, env=env)
    assert checked.returncode == 0, checked.stderr[-3000:]

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(project / "dagster.yaml", home)  # the instance settings the scaffolder wrote
    ran = run(python, TICK, project, "cluster_a", cwd=project, env=env | {"DAGSTER_HOME": str(home)})

    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads(ran.stdout.splitlines()[-1]) == {KEY: True}, ran.stderr[-3000:]
    assert_bit_exact(tmp_path / "merged" / KEY, sample.reference_dir)
