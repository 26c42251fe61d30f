"""``check_tiling``'s overlap search (chunks of the same extent compared on the later dimensions,
others pairwise) finds an overlap exactly when comparing every two chunks does."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from merge_pipeline.errors import MergeError
from merge_pipeline.formats.dcp_files import check_tiling


def _pairwise_overlap(boxes) -> bool:
    return any(
        all(min(a + n, b + m) > max(a, b) for a, n, b, m in zip(o, s, p, t))
        for (o, s), (p, t) in itertools.combinations(boxes, 2)
    )


def test_overlaps_are_found_as_by_comparing_every_pair(tmp_path):
    rng = random.Random(0)
    for _ in range(3000):
        dims = rng.randint(1, 3)
        boxes = [
            (tuple(rng.randint(0, 4) for _ in range(dims)), tuple(rng.randint(0, 3) for _ in range(dims)))
            for _ in range(rng.randint(0, 7))
        ]
        chunks = [ChunkStorageMetadata(offsets, sizes) for offsets, sizes in boxes]
        try:
            check_tiling("t", (8,) * dims, chunks, tmp_path)
            refused = None
        except MergeError as exc:
            refused = exc.problem
        if _pairwise_overlap(boxes):
            assert refused is not None and "overlap" in refused, boxes
        else:
            assert refused is None or "overlap" not in refused, boxes


def test_a_chunk_repeated_in_a_grid_of_thousands_is_refused(tmp_path):
    # 16 layers x 128 experts x 2 row blocks, one chunk each, as megatron-core saves an MoE's experts.
    chunks = [
        ChunkStorageMetadata((layer, expert, rows), (1, 1, 4))
        for layer in range(16)
        for expert in range(128)
        for rows in (0, 4)
    ]
    check_tiling("experts", (16, 128, 8), chunks, tmp_path)
    with pytest.raises(MergeError, match=r"overlap at \(15, 127, 4\)"):
        check_tiling("experts", (16, 128, 8), [*chunks, chunks[-1]], tmp_path)
