"""Loading the code location imports no torch, transformers, megatron or deepspeed: each run worker
loads it before Dagster marks the run STARTED, so those imports (11-16 s on 2 busy cores) belong in
the asset bodies, after the start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT

HEAVY = ("torch", "transformers", "megatron", "deepspeed", "safetensors")
PROBE = (
    f"import sys, merge_pipeline.definitions as d; print(len(d.defs.assets), sorted(set({HEAVY!r}) & set(sys.modules)))"
)


@pytest.mark.slow  # a fresh interpreter: the test process itself has torch loaded
def test_loading_the_code_location_imports_no_torch():
    loaded = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300, check=True
    )

    assets, heavy = loaded.stdout.split(maxsplit=1)
    assert int(assets) > 0 and heavy.strip() == "[]", loaded.stdout
