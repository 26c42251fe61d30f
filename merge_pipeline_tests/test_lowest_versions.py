"""The oldest release of each dependency that pyproject.toml admits (the lower bounds, installed in
.venv-lowest by scripts/setup_lowest.sh): the fast tier passes there too, so each lower bound is one the
code works with. DeepSpeed's own tests need the [deepspeed] extra, which that venv leaves out."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-lowest"
VERSIONS = "import importlib.metadata as m, sys; print(*(m.version(n) for n in sys.argv[1:]))"


@pytest.mark.slow
def test_the_fast_tier_passes_at_the_lower_bounds():
    python = VENV / "bin" / "python"
    assert python.is_file(), f"{python} missing: run scripts/test.sh (scripts/setup_lowest.sh builds it)"
    setup = subprocess.run(["bash", REPO / "scripts" / "setup_lowest.sh"], capture_output=True, text=True)
    assert setup.returncode == 0, setup.stderr[-3000:]  # a no-op unless the lower bounds changed
    pins = [Requirement(line) for line in (VENV / "stamp").read_text().split() if "==" in line]
    found = subprocess.run([python, "-c", VERSIONS, *(p.name for p in pins)], capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-2000:]
    assert [p.specifier.contains(v) for p, v in zip(pins, found.stdout.split())] == [True] * len(pins)

    ran = subprocess.run(
        [python, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider", "-x"]
        + ["--ignore", "merge_pipeline_tests/formats/deepspeed"],
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )

    assert ran.returncode == 0, ran.stdout[-4000:]
