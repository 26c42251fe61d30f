"""The Hub's settings, declared with the merge's in ``watch/location_settings.py``: read from their variables when the
code location loads, a bad word refused there in one line naming the variable, and the token kept as its
variable's name (``EnvVar``), so the resource's config never holds it."""

from __future__ import annotations

import dagster as dg
import pytest

from merge_pipeline.definitions import location
from merge_pipeline.watch.location_settings import HUB_TOKEN
from merge_pipeline_tests.dagster.test_numeric_settings import merge_error

TOKEN = "hf_planted_token_never_in_config"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("MERGE_PIPELINE_HUB_REVISIONS", "tags", "expected one of branch, commit"),
        ("MERGE_PIPELINE_HUB_PRIVATE", "maybe", "expected true or false (1 or 0)"),
        ("MERGE_PIPELINE_HUB_TIMEOUT", "0", "expected a finite number of seconds > 0 and <= 86400"),
        ("MERGE_PIPELINE_PIN_STEPS", "sometimes", "expected true or false (1 or 0)"),
    ],
)
def test_a_bad_hub_or_switch_setting_fails_the_load_in_one_line(monkeypatch, variable, value, expected):
    monkeypatch.setenv("MERGE_PIPELINE_HUB_ORG", "org")
    monkeypatch.setenv(variable, value)

    with pytest.raises(Exception) as refused:
        location()

    assert str(merge_error(refused.value)) == f"{variable} is {value!r}: {expected}"


def test_the_hub_resource_takes_its_variables_at_load_and_the_token_by_name(monkeypatch):
    monkeypatch.setenv("MERGE_PIPELINE_HUB_ORG", "org")
    monkeypatch.setenv("MERGE_PIPELINE_HUB_PRIVATE", "off")
    monkeypatch.setenv("MERGE_PIPELINE_HUB_REVISIONS", "commit")
    monkeypatch.setenv("MERGE_PIPELINE_HUB_TIMEOUT", "7.5")
    monkeypatch.setenv("HF_TOKEN", TOKEN)

    hub = location().resources["hub"]

    assert (hub.organization, hub.private, hub.revisions, hub.timeout_s) == ("org", False, "commit", 7.5)
    assert hub.token == "HF_TOKEN" and TOKEN not in repr(hub) and TOKEN not in str(hub.model_dump())
    with dg.build_resources({"hub": hub}) as resolved:  # as a run resolves it: the upload is given the value
        assert resolved.hub.value(HUB_TOKEN) == TOKEN
