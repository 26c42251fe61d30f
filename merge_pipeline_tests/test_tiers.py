"""The tiers are decided by what a test does (``tiers.py``): a fixture or test that writes a sample
checkpoint or starts a process is slow, however it reaches the writer; what the rule cannot read
fails the fast test that runs it, in one line naming the test."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _pytest.fixtures import FixtureFunctionDefinition

from merge_pipeline_samples import fsdp_fake_pg
from merge_pipeline_samples.fsdp import FsdpSpec, write_fsdp_checkpoint
from merge_pipeline_samples.fsdp_fake_pg import write_fake_pg_checkpoint
from merge_pipeline_samples.megatron import global_values
from merge_pipeline_tests import conftest, tiers

SPEC = FsdpSpec(world_size=2)


def _helper_that_writes(folder):  # a helper of the suite, as helpers.py holds them
    write_fake_pg_checkpoint(folder, SPEC)


WRITERS = {"fake_pg": write_fake_pg_checkpoint}  # a table of writers


def fixture_calling_a_writer(tmp_path):
    write_fsdp_checkpoint(tmp_path / "actor", SPEC, reference_dir=tmp_path / "reference")


def factory_fixture(tmp_path_factory):  # conftest's shape: the writing happens in the function it returns
    return lambda spec: _helper_that_writes(tmp_path_factory.mktemp("fsdp") / "actor")


def fixture_taking_a_writer_from_a_table(tmp_path):
    WRITERS["fake_pg"](tmp_path, SPEC)


def fixture_starting_a_process(tmp_path):
    subprocess.run(["true"], check=True)


def fixture_with_cheap_sample_helpers(tmp_path):  # specs and value helpers of the samples write nothing
    return FsdpSpec(world_size=3), global_values("w", (2, 2), SPEC.dtype)


@pytest.mark.parametrize(
    ("function", "why"),
    [
        (fixture_calling_a_writer, "writes a sample checkpoint (merge_pipeline_samples.fsdp.write_fsdp_checkpoint)"),
        (factory_fixture, "writes a sample checkpoint (merge_pipeline_samples.fsdp_fake_pg.write_fake_pg_checkpoint)"),
        (
            fixture_taking_a_writer_from_a_table,
            "writes a sample checkpoint (merge_pipeline_samples.fsdp_fake_pg.write_fake_pg_checkpoint)",
        ),
        (fixture_starting_a_process, "starts a process (subprocess.run)"),
        (fixture_with_cheap_sample_helpers, None),
    ],
)
def test_a_function_is_slow_by_what_it_reaches(function, why):
    assert tiers.why_slow(function) == why


def test_every_fixture_that_calls_a_sample_writer_by_name_is_slow():
    """Every fixture of the suite's modules imported in this session (all of them in a full run;
    conftest's and this module's at least) that names a ``write_*`` function of the samples anywhere in
    its code, nested functions included: the rule finds it. What it calls decides, not a list."""
    modules = [
        m for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(tiers._FOLLOWED[0])
    ]
    ours = {f.__wrapped__ for m in modules for f in vars(m).values() if isinstance(f, FixtureFunctionDefinition)}
    writing = {f.__qualname__: f for f in ours if any(_is_writer(f.__globals__.get(n)) for n in _names(f.__code__))}

    assert {"fsdp_checkpoint", "dcp_sample", "deepspeed_checkpoints", "megatron_lm_sample"} <= set(writing)
    assert [name for name, f in writing.items() if tiers.why_slow(f) is None] == []
    assert tiers.why_slow(conftest.fresh_copy.__wrapped__) is None  # copying a written sample takes no seconds


def _is_writer(value) -> bool:
    code = getattr(value, "__code__", None)
    return code is not None and code.co_filename.startswith(tiers._SAMPLES_DIR) and value.__name__.startswith("write_")


def _names(code) -> set[str]:
    """Every name ``code`` and the functions nested in it use, read without resolving any."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, type(code))))


def test_sample_code_that_writes_in_a_fast_test_fails_it_in_one_line(tmp_path):
    """A writer reached by a name built at run time is invisible to the rule: the tripwire stops it at
    its first folder, before any work."""
    write = getattr(fsdp_fake_pg, "write_" + "fake_pg_checkpoint")

    with tiers.watching("t.py::test_x"), pytest.raises(tiers.SlowWorkInFastTest) as tripped:
        write(tmp_path / "actor", SPEC)

    assert str(tripped.value).startswith(
        "t.py::test_x: write_fake_pg_checkpoint of merge_pipeline_samples (os.mkdir) runs in a test of the fast tier"
    )
    assert "\n" not in str(tripped.value)
    assert not (tmp_path / "actor").exists()
