"""DCP and DeepSpeed checkpoints saved by many ranks, each by its trainer's own save code in one process
under torch's fake process group, merge bit for bit, under a file limit below the number of rank files.

- DCP, 256 ranks: ``merge_pipeline_samples/dcp_fake_pg.py`` runs torch's own DCP save steps
  (``DefaultSavePlanner``, ``FileSystemWriter``) rank by rank; only the two collectives are passed
  by hand, because under the fake group ``dcp.save``'s gather moves no plans. torchtitan's layout:
  q/k rows in its rotary order, most ranks holding one row of a tensor or none.
- DeepSpeed ZeRO-3, 16 ranks: ``merge_pipeline_samples/deepspeed_fake_pg.py`` runs ``deepspeed.initialize``
  and ``engine.save_checkpoint`` rank by rank (no training step: the fake group's all-reduce moves no
  gradients). Every large parameter spans all 16 partitions.

The benchmark (``benchmarks/world_sizes.py --formats``) runs DCP at 1024 ranks and DeepSpeed at 512
(docs/BENCHMARKS.md, "Other readers at scale").
"""

from __future__ import annotations

import resource
import subprocess
import sys
from dataclasses import replace

import pytest
from safetensors.torch import load_file

from merge_pipeline_samples.dcp_fake_pg import write_fake_pg_dcp
from merge_pipeline_samples.deepspeed import TRAINED_WEIGHTS
from merge_pipeline_tests.helpers import TINY_LLAMA, assert_bit_exact, cli_merge_command

pytestmark = pytest.mark.slow

OPEN_FILES = 128
DCP_RANKS = 256
DEEPSPEED_RANKS = 16


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


def _merge(role_dir, target, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli_merge_command(role_dir, target, *flags), capture_output=True, text=True, preexec_fn=_limit_open_files
    )


@pytest.fixture(scope="module")
def torchtitan_256(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp256")
    dcp_dir = write_fake_pg_dcp(
        root / "step-10", "torchtitan", replace(TINY_LLAMA, world_size=DCP_RANKS), reference_dir=root / "reference"
    )
    return dcp_dir, root / "reference"


def test_dcp_saved_by_256_ranks_merges_bit_exact_under_a_small_file_limit(tmp_path, torchtitan_256):
    dcp_dir, reference = torchtitan_256
    assert len(list(dcp_dir.glob("*.distcp"))) == DCP_RANKS > OPEN_FILES

    merged = _merge(dcp_dir, tmp_path / "out", "--hf_model_path", str(reference))

    assert merged.returncode == 0, merged.stderr
    assert_bit_exact(tmp_path / "out", reference)


def test_a_chunk_archive_unlike_the_others_of_its_kind_is_read_in_full_and_refused(tmp_path, torchtitan_256):
    """Archives of chunks of one shape are checked against the first one parsed, byte for byte up to
    their data: one that differs there is parsed in full, here refused for a record that is not the one
    its directory names (read as its kind's copy, it would have merged)."""
    dcp_dir, reference = torchtitan_256
    folder = tmp_path / "step-10"
    subprocess.run(["cp", "-r", str(dcp_dir), str(folder)], check=True)
    damaged = folder / "__7_0.distcp"
    data = bytearray(damaged.read_bytes())
    # The name in the local header of its second chunk's data record (30 bytes after the header's signature).
    headers = [
        at
        for at in range(len(data))
        if data.startswith(b"archive/data/0", at) and data[at - 30 : at - 26] == b"PK\x03\x04"
    ]
    data[headers[1] + len("archive/data/")] = ord("9")
    damaged.write_bytes(bytes(data))

    merged = _merge(folder, tmp_path / "out", "--hf_model_path", str(reference))

    assert merged.returncode == 1
    [line] = merged.stderr.strip().splitlines()
    assert str(damaged) in line and "local header names a different record" in line, line
    assert not (tmp_path / "out").exists()


def test_deepspeed_zero3_saved_by_16_ranks_merges_bit_exact(tmp_path):
    save_dir, reference = tmp_path / "ckpt", tmp_path / "reference"
    # In its own process, as a trainer's: DeepSpeed leaves this one unable to fork (ENOMEM) after it ran.
    module = "merge_pipeline_samples.deepspeed_fake_pg"
    subprocess.run(
        [
            sys.executable,
            "-m",
            module,
            str(save_dir),
            "--world-size",
            str(DEEPSPEED_RANKS),
            "--reference-dir",
            str(reference),
        ],
        check=True,
        capture_output=True,
    )
    [tag] = (save_dir / "latest").read_text().split()
    assert len(list((save_dir / tag).glob("*_optim_states.pt"))) == DEEPSPEED_RANKS

    merged = _merge(save_dir, tmp_path / "out")

    assert merged.returncode == 0, merged.stderr
    assert_bit_exact(tmp_path / "out", load_file(reference / TRAINED_WEIGHTS))
