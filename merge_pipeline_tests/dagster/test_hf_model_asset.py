"""The ``hf_model`` step called directly with ``build_asset_context``, no run or daemon (the fast tier): a small
consolidated HF save (NeMo-Automodel's ``<role>/model/``, written in this process) is published bit for bit and
the three blocking checks' results follow its materialization."""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.run_config import MergeConfig
from merge_pipeline.engine.publish import staging_path
from merge_pipeline.formats.step_folders import TRACKER
from merge_pipeline.hf.blocking_checks import CHECK_NAMES
from merge_pipeline.watch.keys import PASSED
from merge_pipeline_samples.fsdp import FsdpSpec, write_nemo_automodel_checkpoint
from merge_pipeline_tests.dagster.helpers import asset
from merge_pipeline_tests.helpers import assert_bit_exact

KEY = "nemo/global_step_3/actor"


def test_hf_model_publishes_and_reports_each_stage(tmp_path, roots):
    role_dir = roots.checkpoints / "nemo" / "global_step_3" / "actor"
    write_nemo_automodel_checkpoint(role_dir, FsdpSpec(), reference_dir=tmp_path / "reference")
    (roots.checkpoints / "nemo" / TRACKER).write_text("3")
    settings = roots.settings()

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("checkpoints", [KEY])
        context = dg.build_asset_context(partition_key=KEY, instance=instance, resources={"settings": settings})
        # The three stages' results, as a run records them.
        results = list(asset("hf_model")(context, config=MergeConfig()))

    assert [r.asset_key for r in results[:3]] == [
        dg.AssetKey(stage) for stage in ("parallel_config", "state_dict", "hf_model")
    ]
    assert results[2].metadata[PASSED].value == CHECK_NAMES  # the blocking checks, passed before publishing
    # ... and each an asset check of hf_model, passed, recorded after its materialization
    assert all(isinstance(r, dg.AssetCheckResult) for r in results[3:])
    assert [(r.asset_key, r.check_name, r.passed) for r in results[3:]] == [
        (dg.AssetKey("hf_model"), name, True) for name in CHECK_NAMES
    ]
    target = roots.target(KEY)
    assert_bit_exact(target, tmp_path / "reference")
    assert not staging_path(target).exists()
    assert results[0].metadata["backend"].value == "hf"
