"""The committed table of Megatron-Bridge's name mappings (``merge_pipeline/bridge_mappings.json``) is what
``merge_pipeline_samples/bridge_mappings.py`` produces from the installed bridge (``.venv-bridge``): a
bridge upgrade without regenerating it fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline_tests.helpers import write_with_release

TABLE = Path(__file__).resolve().parents[3] / "merge_pipeline" / "bridge_mappings.json"


@pytest.mark.slow
def test_committed_table_is_what_the_installed_bridge_says(tmp_path):
    generated = write_with_release(".venv-bridge", "bridge_mappings.py", tmp_path / "bridge_mappings.json")
    assert generated.read_text() == TABLE.read_text(), (
        "merge_pipeline/bridge_mappings.json is stale: rerun "
        ".venv-bridge/bin/python merge_pipeline_samples/bridge_mappings.py merge_pipeline/bridge_mappings.json"
    )
