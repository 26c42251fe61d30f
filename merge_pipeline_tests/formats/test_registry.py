"""The reader registry: a format is one module of ``merge_pipeline.formats`` exposing ``READER``."""

from __future__ import annotations

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.formats import BACKENDS, READERS, detect_backend, reader
from merge_pipeline.sample_checkpoints.fsdp import FsdpSpec


@pytest.mark.parametrize("name", READERS)
def test_each_reader_module_exposes_one_reader_named_as_its_backend(name):
    found = reader(name)
    assert (found.name, callable(found.detect), callable(found.plan), bool(found.looks_for)) == (name, True, True, True)


def test_backends_are_auto_and_the_registered_readers():
    assert BACKENDS == ("auto", *READERS)


def test_an_unknown_backend_is_one_line_listing_the_known_ones():
    with pytest.raises(
        MergeError, match=r"^--backend must be one of auto, fsdp, megatron, hf, deepspeed, dcp, not 'zip'$"
    ):
        reader("zip")


def test_auto_detection_asks_the_readers_in_order(fsdp_checkpoint, tmp_path):
    assert detect_backend(fsdp_checkpoint(FsdpSpec()).role_dir) == "fsdp"
    with pytest.raises(MergeError) as error:
        detect_backend(tmp_path)
    assert all(reader(name).looks_for in str(error.value) for name in READERS)
