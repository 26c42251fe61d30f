"""The folder checks read safetensors headers with the safetensors package: a damaged file is one line naming it."""

from __future__ import annotations

import pytest

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.file_names import INDEX
from merge_pipeline.hf.folder_checks import index_problems, weight_files


def test_a_merged_folder_has_no_index_problems(good_target):
    headers = weight_files(good_target)
    assert index_problems(good_target) == [] and len(headers) == 1 and not (good_target / INDEX).exists()


@pytest.mark.parametrize("damage", [b"\x00\x00\x00", b"\xff" * 8 + b"{}"], ids=["too-short", "absurd-header-length"])
def test_a_damaged_weight_file_is_one_line_naming_it(good_target, damage):
    (shard,) = good_target.glob("model*.safetensors")
    shard.write_bytes(damage)
    with pytest.raises(MergeError) as error:
        index_problems(good_target)
    assert str(error.value).startswith(f"{shard}: not a readable safetensors file")
