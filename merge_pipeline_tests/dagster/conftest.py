"""Fixtures for the Dagster code location's tests."""

from __future__ import annotations

import shutil

import dagster as dg
import pytest

from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT, Roots


@pytest.fixture
def roots(tmp_path) -> Roots:
    """An empty watched checkpoint root and an output root, in a temp folder."""
    found = Roots(tmp_path / "checkpoints", tmp_path / "merged")
    found.checkpoints.mkdir()
    return found


@pytest.fixture
def instance(tmp_path, monkeypatch):
    """A real, persistent instance configured by the project's dagster.yaml, in a temp DAGSTER_HOME."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(PROJECT_ROOT / "dagster.yaml", home)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.from_config(str(home)) as instance:
        yield instance
