"""What a failed merge leaves in the instance for the three checks: no result, only Dagster's own plan."""

from __future__ import annotations

from merge_pipeline.defs.checks import CHECK_SPECS
from merge_pipeline_tests.defs.helpers import materialize

KEY = "run/global_step_3/actor"


def test_a_merge_that_fails_before_the_checks_records_no_check_result(roots, instance):
    result = materialize(instance, roots.settings(), KEY)  # nothing saved there: the merge fails first

    assert not result.success
    for spec in CHECK_SPECS:
        [record] = instance.event_log_storage.get_asset_check_execution_history(spec.key, limit=5)
        # planned by Dagster when it created the run, never evaluated: no "failed" for an unread folder
        assert (record.status.value, record.partition) == ("PLANNED", KEY)
