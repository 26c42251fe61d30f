"""Every numeric setting is checked when the code location loads: one line naming the setting (the
variable, or the component's defs.yaml field), the value and what is expected with its unit, the same
in the environment as in defs.yaml (before: a traceback in every tick, 15 lines at load, or nan / inf /
negative values taken: waiting forever, or no settle time at all)."""

from __future__ import annotations

import subprocess
import sys
import time
import tracemalloc
import uuid

import dagster as dg
import pytest

from merge_pipeline.definitions import location
from merge_pipeline.errors import MergeError
from merge_pipeline.watch.location_settings import SETTLE_SECONDS
from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT

JUNK = ["abc", "10s", "nan", "inf", "-5"]
ENVIRONMENT = {
    "MERGE_PIPELINE_SETTLE_SECONDS": "expected a finite number of seconds >= 0 and <= 604800",
    "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS": "expected a whole number of seconds >= 0 and <= 86400",
}
DEFS_YAML = {
    "settle_seconds": "expected a finite number of seconds >= 0 and <= 604800",
    "sensor_interval_seconds": "expected a whole number of seconds >= 0 and <= 86400",
    "freshness_minutes": "expected a finite number of minutes >= 1 and <= 527040",
}


@pytest.mark.parametrize("value", JUNK)
@pytest.mark.parametrize("variable", ENVIRONMENT)
def test_a_bad_environment_setting_fails_the_load_in_one_line(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)

    with pytest.raises(Exception) as refused:
        location()  # what definitions.py loads

    assert str(merge_error(refused.value)) == f"{variable} is {value!r}: {ENVIRONMENT[variable]}"


@pytest.mark.parametrize("value", ["abc", "10s", "0GB", "-1GB"])
def test_a_bad_smoke_test_size_fails_the_load_in_one_line(monkeypatch, value):
    monkeypatch.setenv("MERGE_PIPELINE_SMOKE_MAX_SIZE", value)

    with pytest.raises(Exception) as refused:
        location()

    assert str(merge_error(refused.value)).startswith(
        f"MERGE_PIPELINE_SMOKE_MAX_SIZE is {value!r}: expected a size in bytes"
    )


@pytest.mark.slow  # a fresh interpreter loads the code location as dagster's code server does
def test_the_code_location_load_says_the_one_line():
    loaded = subprocess.run(
        [sys.executable, "-c", "import merge_pipeline.definitions"],
        cwd=PROJECT_ROOT,
        env={"PATH": "/usr/bin:/bin", "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS": "10s"},
        capture_output=True,
        text=True,
        timeout=300,
    )

    # dg names the component that failed (merge/defs.yaml), caused by our line
    assert loaded.returncode != 0
    assert "defs.yaml (MergeCheckpoints) (error)" in loaded.stderr, loaded.stderr
    assert (
        "merge_pipeline.errors.MergeError: MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS is '10s': expected a whole number of seconds >= 0 and <= 86400"
        in loaded.stderr.splitlines()
    )


def merge_error(raised: BaseException) -> MergeError | None:
    """Our one line, the cause of the error dg raises naming the component that failed to load."""
    while raised is not None and not isinstance(raised, MergeError):
        raised = raised.__cause__
    return raised


def load_component(tmp_path, monkeypatch, attribute: str) -> dg.Definitions:
    """A dg project holding one MergeCheckpoints component whose defs.yaml sets ``attribute``, loaded as dg does."""
    module = f"clusters_{uuid.uuid4().hex}"  # a fresh module each time: Python caches imported packages
    defs_dir = tmp_path / "src" / module / "defs"
    (defs_dir / "cluster_a").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text(
        f'[project]\nname = "{module}"\nversion = "0"\n\n[tool.dg]\ndirectory_type = "project"\n\n'
        f'[tool.dg.project]\nroot_module = "{module}"\n'
    )
    (defs_dir.parent / "__init__.py").touch()
    (defs_dir / "__init__.py").touch()
    (defs_dir / "cluster_a" / "defs.yaml").write_text(
        f"type: merge_pipeline.MergeCheckpoints\nattributes:\n  checkpoint_roots: [{tmp_path}/checkpoints]\n"
        f"  output_root: {tmp_path}/merged\n  {attribute}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    return dg.load_from_defs_folder(path_within_project=tmp_path)


@pytest.mark.parametrize("value", ["abc", "10s", ".nan", ".inf", "-5"])
@pytest.mark.parametrize("field", DEFS_YAML)
def test_a_bad_defs_yaml_setting_fails_the_load_in_the_same_line(tmp_path, monkeypatch, field, value):
    with pytest.raises(Exception) as refused:
        load_component(tmp_path, monkeypatch, f"{field}: {value}")

    # dg reports the component that failed to load (cluster_a/defs.yaml) and, as its cause, our line
    cause = merge_error(refused.value)
    shown = {"abc": "'abc'", "10s": "'10s'", ".nan": "nan", ".inf": "inf", "-5": "-5.0"}[value]
    assert str(cause) == f"defs.yaml {field} is {shown}: {DEFS_YAML[field]}"


def test_good_settings_are_taken_from_the_environment_and_defs_yaml(tmp_path, monkeypatch):
    monkeypatch.setenv("MERGE_PIPELINE_SETTLE_SECONDS", "2.5")
    monkeypatch.setenv("MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS", "30.0")  # a whole number, written as a float

    from_env = location()
    from_yaml = load_component(tmp_path, monkeypatch, "settle_seconds: 0\n  sensor_interval_seconds: 20.0")

    assert from_env.resolve_sensor_def("new_checkpoint_sensor").minimum_interval_seconds == 30
    assert from_env.resources["settings"].value(SETTLE_SECONDS) == 2.5
    assert from_yaml.resolve_sensor_def("cluster_a__new_checkpoint_sensor").minimum_interval_seconds == 20
    assert from_yaml.resources["cluster_a__settings"].value(SETTLE_SECONDS) == 0


HUGE = {
    "MERGE_PIPELINE_FRESHNESS_MINUTES": "expected a finite number of minutes >= 1 and <= 527040",
    "MERGE_PIPELINE_SETTLE_SECONDS": "expected a finite number of seconds >= 0 and <= 604800",
    "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS": "expected a whole number of seconds >= 0 and <= 86400",
}


@pytest.mark.parametrize("variable", HUGE)
def test_a_huge_setting_fails_the_load_in_one_line(monkeypatch, variable):
    """Before: 1e300 minutes failed the load with an OverflowError traceback (a timedelta); 1e300 seconds
    were taken."""
    monkeypatch.setenv(variable, "1e300")

    with pytest.raises(Exception) as refused:
        location()

    assert str(merge_error(refused.value)) == f"{variable} is '1e300': {HUGE[variable]}"


@pytest.mark.parametrize("last_k", [100_000_000, 1e12])
def test_averaging_more_steps_than_can_exist_is_one_line_at_once(last_k):
    """Before: last_k 100000000 built 840 MB of weights at load, 1e12 a MemoryError."""
    from merge_pipeline.dagster.averaged_model import Averaging

    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(MergeError) as refused:
            Averaging(last_k=last_k)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert str(refused.value) == f"averaging: last_k {int(last_k)}: expected a whole number of steps from 2 to 10,000"
    assert time.monotonic() - started < 1 and peak < 1 << 20
