"""DCP ``.metadata`` that points chunks at the wrong bytes: refused, naming the file, before any copy.

Each case rewrites a real megatron-core checkpoint's metadata (as torch would pickle it) so that a
merge would read bytes from outside ``dist_ckpt/``, from another tensor's chunk, or from nowhere.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from merge_pipeline.errors import MergeError
from merge_pipeline_tests.formats.megatron.test_errors import rewrite_metadata
from merge_pipeline_tests.helpers import megatron_plan

SAMPLE = "qwen2_tp2"
INPUT_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"  # [layers, hidden], fp32
POST_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"  # same shape and dtype


def repoint_file(dist_dir, old_name, new_name):
    """Make every chunk stored in ``old_name`` say it is stored in ``new_name``."""

    def change(metadata):
        for index, info in metadata.storage_data.items():
            if info.relative_path == old_name:
                metadata.storage_data[index] = dataclasses.replace(info, relative_path=new_name)

    rewrite_metadata(dist_dir, change)


def storage_index(metadata, key, chunk=0):
    return MetadataIndex(key, metadata.state_dict_metadata[key].chunks[chunk].offsets)


@pytest.fixture
def role(fresh_megatron):
    return fresh_megatron(SAMPLE).role_dir


def test_parent_directory_in_a_file_name_is_refused(role):
    dist_dir = role / "dist_ckpt"
    shutil.copy(dist_dir / "__0_0.distcp", role / "__0_0.distcp")  # readable, but outside dist_ckpt/
    repoint_file(dist_dir, "__0_0.distcp", "../__0_0.distcp")
    with pytest.raises(MergeError, match=r"chunk file '\.\./__0_0\.distcp' lies outside dist_ckpt/") as error:
        megatron_plan(role)
    assert error.value.path == dist_dir / ".metadata"


def test_absolute_file_name_is_refused(role, tmp_path):
    elsewhere = tmp_path / "elsewhere.distcp"
    shutil.copy(role / "dist_ckpt" / "__0_0.distcp", elsewhere)
    repoint_file(role / "dist_ckpt", "__0_0.distcp", str(elsewhere))
    with pytest.raises(MergeError, match="lies outside dist_ckpt/") as error:
        megatron_plan(role)
    assert error.value.path == role / "dist_ckpt" / ".metadata"


def test_symlink_out_of_dist_ckpt_is_refused(role, tmp_path):
    dist_dir = role / "dist_ckpt"
    elsewhere = tmp_path / "elsewhere.distcp"
    shutil.copy(dist_dir / "__0_0.distcp", elsewhere)
    os.symlink(elsewhere, dist_dir / "link.distcp")
    repoint_file(dist_dir, "__0_0.distcp", "link.distcp")
    with pytest.raises(MergeError, match="symlink out of dist_ckpt/") as error:
        megatron_plan(role)
    assert error.value.path == dist_dir / "link.distcp"


def test_symlink_inside_dist_ckpt_still_merges(role, megatron_samples):
    dist_dir = role / "dist_ckpt"
    os.symlink("__0_0.distcp", dist_dir / "alias.distcp")
    repoint_file(dist_dir, "__0_0.distcp", "alias.distcp")
    with megatron_plan(role) as planned, megatron_plan(megatron_samples[SAMPLE].role_dir) as original:
        for ours, theirs in zip(planned.tensors, original.tensors, strict=True):
            assert ours.name == theirs.name and torch.equal(
                ours.load().view(torch.uint8), theirs.load().view(torch.uint8)
            ), ours.name


def test_two_tensors_reading_the_same_bytes_are_refused(role):
    """post_attention_layernorm silently becoming a copy of input_layernorm."""

    def share(metadata):
        metadata.storage_data[storage_index(metadata, POST_NORM)] = metadata.storage_data[
            storage_index(metadata, INPUT_NORM)
        ]

    rewrite_metadata(role / "dist_ckpt", share)
    with pytest.raises(
        MergeError, match=f"{POST_NORM} and {INPUT_NORM}: chunks share bytes .* of __0_0.distcp"
    ) as error:
        megatron_plan(role)
    assert error.value.path == role / "dist_ckpt" / ".metadata"


def test_negative_byte_offset_is_refused(role):
    def before_the_file(metadata):
        index = storage_index(metadata, INPUT_NORM)
        metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], offset=-100)

    rewrite_metadata(role / "dist_ckpt", before_the_file)
    with pytest.raises(MergeError, match=f"{INPUT_NORM}: chunk at .* has byte range offset -100") as error:
        megatron_plan(role)
    assert error.value.path == role / "dist_ckpt" / ".metadata"


def test_chunks_overlapping_in_the_global_tensor_are_refused(role):
    def overlap(metadata):
        chunk = metadata.state_dict_metadata["embedding.word_embeddings.weight"].chunks[1]
        chunk.offsets = torch.Size([32, 0])  # rows 32..95 now overlap chunk 0's rows 0..63

    rewrite_metadata(role / "dist_ckpt", overlap)
    with pytest.raises(MergeError, match=r"embedding.word_embeddings.weight: saved chunks overlap at \(32, 0\)"):
        megatron_plan(role)


def test_chunk_offsets_of_the_wrong_rank_are_refused(role):
    def one_dimensional(metadata):
        metadata.state_dict_metadata["embedding.word_embeddings.weight"].chunks[1].offsets = torch.Size([64])

    rewrite_metadata(role / "dist_ckpt", one_dimensional)
    with pytest.raises(
        MergeError,
        match=r"embedding.word_embeddings.weight: chunk at \(64,\) .* is not a block of a tensor of shape \(128, 64\)",
    ):
        megatron_plan(role)
