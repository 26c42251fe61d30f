"""The FSDP reader on a small synthetic save, in this process (the fast tier): rank files written by torch's fake
process group (one process plays every rank), the vocab's 1003 rows split unevenly over 3 ranks, merged bit for bit."""

from __future__ import annotations

import json
from dataclasses import replace

from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_tests.helpers import TINY_LLAMA, assert_bit_exact, merge_ok

SPEC = replace(TINY_LLAMA, world_size=3)


def test_uneven_fsdp2_shards_merge_bit_exact(capsys, tmp_path):
    role_dir = tmp_path / "global_step_1" / "actor"
    write_fake_pg_checkpoint(role_dir, SPEC, reference_dir=tmp_path / "reference")

    merge_ok(capsys, role_dir, tmp_path / "out", "--max-shard-size", "64KB")

    assert_bit_exact(tmp_path / "out", tmp_path / "reference")
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1  # the output plan split the shards
    source = json.loads((tmp_path / "out" / MANIFEST).read_text())["source"]
    assert source["backend"] == "fsdp" and source["layout"]["world_size"] == 3
