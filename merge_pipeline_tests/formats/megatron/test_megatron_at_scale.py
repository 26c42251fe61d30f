"""Megatron-Core checkpoints of 64 ranks, saved by megatron-core's own code in one process under torch's
fake process group (``merge_pipeline_samples/megatron_fake_pg.py``: ``initialize_model_parallel``, the
``GPTModel`` of each rank, ``dist_checkpointing.save``'s torch_dist steps; only the collectives that
gather the local plans, the write results and the shard metadata are passed by hand), merge bit for bit
from the CLI under a file limit below the number of files:

- a dense Llama at TP=8 x PP=8: every stacked layer tensor in 64 chunks, 128 ``.distcp`` files;
- a Mixtral MoE at TP=2 x EP=8 x PP=4 (expert TP 2, data parallel 8): 8 experts, one per EP rank.

Every rank's model holds its slices of the same seeded global tensors, from which the reference is
built. The benchmark (``benchmarks/world_sizes.py --formats megatron --world-sizes 64``) merges a ~258M
model at TP=8 x PP=8 (docs/BENCHMARKS.md, "Other readers at scale").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from merge_pipeline_tests.formats.test_readers_at_scale import OPEN_FILES, _merge
from merge_pipeline_tests.helpers import assert_bit_exact

pytestmark = pytest.mark.slow

PARALLEL = {"llama_tp8_pp8": (8, 8, 1), "mixtral_tp2_ep8_pp4": (2, 4, 8)}  # TP, PP, EP


@pytest.fixture(scope="module")
def saved_by_64_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron64")
    # In its own process, as a trainer's: the writer patches torch for megatron-core on CPU.
    command = [sys.executable, "-m", "merge_pipeline_samples.megatron_fake_pg", str(root)]
    for name in PARALLEL:
        command += ["--variant", name]
    subprocess.run(command, check=True, capture_output=True, timeout=600)
    return root


@pytest.mark.parametrize("variant", sorted(PARALLEL))
def test_megatron_saved_by_64_ranks_merges_bit_exact_under_a_small_file_limit(tmp_path, saved_by_64_ranks, variant):
    role_dir = saved_by_64_ranks / variant / "actor"
    files = [p for p in (role_dir / "dist_ckpt").iterdir()]
    ranks = {p.name.split("_")[2] for p in files if p.suffix == ".distcp"}
    assert len(files) > OPEN_FILES and len(ranks) == 64, (len(files), len(ranks))
    settings = json.loads((role_dir / "transformer_config.json").read_text())
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")
    assert tuple(settings[n] for n in names) == PARALLEL[variant]

    merged = _merge(role_dir, tmp_path / "out", "--backend", "auto")

    assert merged.returncode == 0, merged.stderr
    assert_bit_exact(tmp_path / "out", saved_by_64_ranks / variant / "reference")
