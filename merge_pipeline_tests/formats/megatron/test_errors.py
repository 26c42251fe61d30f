"""Every bad Megatron input is one ``MergeError`` naming the file that is wrong."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch.distributed.checkpoint as dcp

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.architecture import check_plan_against_architecture, expected_tensors
from merge_pipeline_tests.helpers import megatron_plan


def planned_and_checked(role_dir):
    with megatron_plan(role_dir) as p:
        hf_dir = role_dir / "huggingface"
        expected = expected_tensors(hf_dir, value_model=p.is_value_model, trust_remote_code=False)
        check_plan_against_architecture(p.tensors, expected, hf_dir / "config.json")


def edit_json(path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def rewrite_metadata(dist_dir, change):
    """Apply ``change`` to the DCP metadata object and store it again (as torch would)."""
    metadata = dcp.FileSystemReader(str(dist_dir)).read_metadata()
    change(metadata)
    (dist_dir / ".metadata").write_bytes(pickle.dumps(metadata))


def test_missing_distcp_file(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    victim = role / "dist_ckpt" / "__1_0.distcp"
    victim.unlink()
    with pytest.raises(MergeError) as error:
        megatron_plan(role)
    assert error.value.path == victim and "missing" in str(error.value)


def test_corrupt_metadata(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    path = role / "dist_ckpt" / ".metadata"
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(MergeError, match="corrupt DCP metadata") as error:
        megatron_plan(role)
    assert error.value.path == path


def test_metadata_that_would_run_code_is_refused(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    path = role / "dist_ckpt" / ".metadata"
    # any global outside the DCP classes, spelled out: pickling print itself names whatever the process's
    # print is (Ray, once imported, replaces it with its own)
    path.write_bytes(b"\x80\x02cbuiltins\nprint\n.")
    with pytest.raises(MergeError, match="refused to load builtins.print") as error:
        megatron_plan(role)
    assert error.value.path == path


def test_metadata_json_of_another_backend(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    edit_json(role / "dist_ckpt" / "metadata.json", sharded_backend="zarr")
    with pytest.raises(MergeError, match="'zarr'") as error:
        megatron_plan(role)
    assert error.value.path == role / "dist_ckpt" / "metadata.json"


def test_config_sizes_disagreeing_with_the_tensors(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    config = role / "huggingface" / "config.json"
    edit_json(config, num_key_value_heads=4)  # QKV rows no longer add up
    with pytest.raises(MergeError, match="sizes disagree") as error:
        megatron_plan(role)
    assert error.value.path == config


def test_config_ffn_size_disagreeing_is_caught_by_the_architecture_check(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    config = role / "huggingface" / "config.json"
    edit_json(config, intermediate_size=80)
    with pytest.raises(MergeError, match=r"shape mismatch .*mlp.down_proj.weight \(64, 96\) vs \(64, 80\)") as error:
        planned_and_checked(role)
    assert error.value.path == config


def test_no_huggingface_config(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    (role / "huggingface" / "config.json").unlink()
    with pytest.raises(MergeError, match="not found") as error:
        megatron_plan(role)
    assert error.value.path == role / "huggingface" / "config.json"


def test_unsupported_architecture_is_named(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    config = role / "huggingface" / "config.json"
    edit_json(config, architectures=["GPT2LMHeadModel"])
    with pytest.raises(MergeError, match="unsupported architecture GPT2LMHeadModel") as error:
        megatron_plan(role)
    assert error.value.path == config


def test_a_key_with_no_hf_name_is_an_error_not_dropped(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    dist_dir = role / "dist_ckpt"

    def rename(metadata):
        key = "decoder.layers.self_attention.linear_proj.weight"
        metadata.state_dict_metadata["decoder.layers.self_attention.mystery_proj.weight"] = (
            metadata.state_dict_metadata.pop(key)
        )

    rewrite_metadata(dist_dir, rename)
    with pytest.raises(MergeError, match="no Hugging Face name .*mystery_proj") as error:
        megatron_plan(role)
    assert error.value.path == dist_dir / ".metadata"


def test_a_missing_layer_is_caught_by_the_architecture_check(fresh_megatron):
    role = fresh_megatron("qwen3_moe_tp2_per_layer").role_dir

    def drop_layer_3(metadata):
        for key in [k for k in metadata.state_dict_metadata if k.startswith("decoder.layers.3.")]:
            del metadata.state_dict_metadata[key]

    rewrite_metadata(role / "dist_ckpt", drop_layer_3)
    with pytest.raises(MergeError, match=r"missing: model\.layers\.3\.") as error:
        planned_and_checked(role)
    assert error.value.path == role / "huggingface" / "config.json"


def test_chunks_that_leave_a_gap_are_refused(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir

    def drop_chunk(metadata):
        metadata.state_dict_metadata["embedding.word_embeddings.weight"].chunks.pop()

    rewrite_metadata(role / "dist_ckpt", drop_chunk)
    with pytest.raises(MergeError, match="do not cover the whole tensor"):
        megatron_plan(role)


def test_truncated_distcp_file(fresh_megatron):
    role = fresh_megatron("qwen2_tp2").role_dir
    victim = role / "dist_ckpt" / "__0_1.distcp"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(MergeError, match="truncated") as error:
        megatron_plan(role)
    assert error.value.path == victim


def test_value_flag_contradicting_the_checkpoint(megatron_samples):
    with pytest.raises(MergeError, match="value model requested but output_layer.weight has 128 rows"):
        megatron_plan(megatron_samples["qwen2_tp2"].role_dir, is_value_model=True)


def test_untied_config_without_output_layer(fresh_megatron):
    role = fresh_megatron("llama_tied_pp2").role_dir
    edit_json(role / "huggingface" / "config.json", tie_word_embeddings=False)
    with pytest.raises(MergeError, match="--tie-word-embedding"):
        megatron_plan(role)


def test_hf_weights_header_out_of_bounds(fresh_megatron):
    role = fresh_megatron("qwen2_hf_weights").role_dir
    victim = role / "huggingface" / "model-00001-of-00002.safetensors"
    victim.write_bytes(struct.pack("<Q", 1 << 40) + victim.read_bytes()[8:])
    with pytest.raises(MergeError, match="header length") as error:
        megatron_plan(role)
    assert error.value.path == victim


def test_hf_weights_index_naming_the_wrong_file(fresh_megatron):
    role = fresh_megatron("qwen2_hf_weights").role_dir
    index_path = role / "huggingface" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    index["weight_map"][name] = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    with pytest.raises(MergeError, match="model.norm.weight is in .* but the index says") as error:
        megatron_plan(role)
    assert error.value.path == index_path
