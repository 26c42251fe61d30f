"""The sample FSDP checkpoints are real: torch FSDP wrote them, and they reassemble to the reference."""

from __future__ import annotations

import json
import pickle
import time

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (puts DTensor on torch.load's weights_only list)
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

from merge_pipeline_samples.fsdp import FsdpSpec, write_fsdp_checkpoint

pytestmark = pytest.mark.slow

UNEVEN = FsdpSpec(world_size=3)  # vocab 1003 over 3 ranks: 335 + 335 + 333 rows
TINY = FsdpSpec(  # k_proj.bias has 2 rows over 4 ranks: ranks 2 and 3 hold none
    world_size=4,
    fsdp_version=1,
    hidden_size=8,
    num_key_value_heads=1,
    intermediate_size=16,
    vocab_size=50,
    dtype=torch.bfloat16,
    tie_word_embeddings=True,
)
HSDP = FsdpSpec(world_size=4, mesh=(2, 2))
SINGLE = FsdpSpec(world_size=1, fsdp_version=1)
LEGACY_SINGLE = FsdpSpec(world_size=1, legacy_no_fsdp_config=True)  # FSDP2 on one rank still writes DTensors
LORA = FsdpSpec(lora=(4, 8))
CRITIC = FsdpSpec(arch="llama", critic=True)


def load_ranks(sample) -> list[dict]:
    world_size = sample.spec.world_size
    return [
        torch.load(sample.role_dir / f"model_world_size_{world_size}_rank_{rank}.pt", weights_only=True, mmap=True)
        for rank in range(world_size)
    ]


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().flatten().view(torch.uint8)


def reassemble(values: list) -> torch.Tensor:
    """One key's rank values -> the global tensor: shards concatenated in mesh-coordinate order."""
    if not isinstance(values[0], DTensor):
        return values[0]
    by_shard = {value.device_mesh.get_coordinate()[-1]: value.to_local() for value in values}
    return torch.cat([by_shard[index] for index in range(len(by_shard))])


@pytest.mark.parametrize(
    "spec",
    [UNEVEN, TINY, HSDP, SINGLE, LEGACY_SINGLE, LORA, CRITIC],
    ids=["uneven", "tiny", "hsdp", "single", "legacy-single", "lora", "critic"],
)
def test_shards_reassemble_to_the_reference_bit_for_bit(fsdp_checkpoint, spec):
    sample = fsdp_checkpoint(spec)
    ranks, reference = load_ranks(sample), load_file(sample.reference_dir / "model.safetensors")
    assert all(set(state) == set(reference) for state in ranks)
    for name, expected in reference.items():
        values = [state[name] for state in ranks]
        assert expected.dtype == spec.dtype
        assert isinstance(values[0], DTensor) == (spec.fsdp_version == 2 or spec.world_size > 1)
        if isinstance(values[0], DTensor):
            assert {value.placements for value in values} == {
                (Shard(0),) if spec.mesh is None else (Replicate(), Shard(0))
            }
            assert {value.device_mesh.mesh_dim_names for value in values} == {spec.mesh_dim_names}
            assert values[0].shape == expected.shape
        got = reassemble(values)
        assert got.shape == expected.shape and torch.equal(raw(got), raw(expected)), name


def test_uneven_rows_are_torch_chunks_in_rank_order(fsdp_checkpoint):
    ranks = load_ranks(fsdp_checkpoint(UNEVEN))
    embed = [state["model.embed_tokens.weight"] for state in ranks]
    assert [value.to_local().shape[0] for value in embed] == [335, 335, 333]
    assert [value.device_mesh.get_coordinate() for value in embed] == [(0,), (1,), (2,)]


def test_a_tiny_tensor_leaves_some_ranks_empty(fsdp_checkpoint):
    ranks = load_ranks(fsdp_checkpoint(TINY))
    bias = [state["model.layers.0.self_attn.k_proj.bias"].to_local() for state in ranks]
    assert [tuple(local.shape) for local in bias] == [(1,), (1,), (0,), (0,)]
    for state in ranks:  # tied embeddings: both names are written
        assert torch.equal(raw(state["lm_head.weight"].to_local()), raw(state["model.embed_tokens.weight"].to_local()))


def test_hsdp_replica_groups_hold_identical_shards(fsdp_checkpoint):
    ranks = load_ranks(fsdp_checkpoint(HSDP))
    for name, value in ranks[0].items():
        assert value.device_mesh.shape == (2, 2)
        assert [state[name].device_mesh.get_coordinate() for state in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for rank in (0, 1):  # rank r and r + 2 replicate the same shard
            assert torch.equal(raw(ranks[rank][name].to_local()), raw(ranks[rank + 2][name].to_local()))


def test_fsdp1_on_one_rank_writes_plain_tensors_and_verl_side_files(fsdp_checkpoint):
    role_dir = fsdp_checkpoint(SINGLE).role_dir
    (state,) = load_ranks(fsdp_checkpoint(SINGLE))
    assert all(type(value) is torch.Tensor for value in state.values())
    assert json.loads((role_dir / "fsdp_config.json").read_text()) == {"FSDP_version": 1, "world_size": 1}
    optimizer = torch.load(role_dir / "optim_world_size_1_rank_0.pt", weights_only=True)
    assert optimizer["state"] and optimizer["param_groups"]
    with pytest.raises(pickle.UnpicklingError):  # numpy RNG state, as in verl's extra_state
        torch.load(role_dir / "extra_state_world_size_1_rank_0.pt", weights_only=True)


def test_legacy_checkpoint_has_no_fsdp_config(fsdp_checkpoint):
    role_dir = fsdp_checkpoint(LEGACY_SINGLE).role_dir
    assert not (role_dir / "fsdp_config.json").exists()
    assert (role_dir / "model_world_size_1_rank_0.pt").is_file()


def test_lora_checkpoint_has_peft_keys_and_a_non_zero_update(fsdp_checkpoint):
    sample = fsdp_checkpoint(LORA)
    meta = json.loads((sample.role_dir / "lora_train_meta.json").read_text())
    assert meta == {"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}
    reference = load_file(sample.reference_dir / "model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj."
    assert {f"{prefix}base_layer.weight", f"{prefix}lora_A.default.weight", f"{prefix}lora_B.default.weight"} <= set(
        reference
    )
    assert reference[f"{prefix}lora_B.default.weight"].abs().min() > 0


def test_critic_is_token_classification_with_a_causal_lm_hf_config(fsdp_checkpoint):
    sample = fsdp_checkpoint(CRITIC)
    assert sample.role_dir.name == "critic"
    hf_config = json.loads((sample.role_dir / "huggingface" / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    model = AutoModelForTokenClassification.from_pretrained(sample.reference_dir)
    assert type(model).__name__ == "LlamaForTokenClassification" and model.config.num_labels == 1
    reference = load_file(sample.reference_dir / "model.safetensors")
    assert "lm_head.weight" not in reference and reference["score.weight"].shape == (1, CRITIC.hidden_size)
    assert all(torch.equal(value, reference[name]) for name, value in model.state_dict().items())


def test_huggingface_folder_loads_with_transformers(fsdp_checkpoint):
    hf_dir = fsdp_checkpoint(UNEVEN).role_dir / "huggingface"
    config = AutoConfig.from_pretrained(hf_dir)
    assert config.architectures == ["Qwen2ForCausalLM"] and config.dtype == torch.float32
    assert (hf_dir / "generation_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert len(tokenizer) <= UNEVEN.vocab_size and tokenizer.eos_token_id == config.eos_token_id
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Solve the problem."}], tokenize=False)
    assert chat == "<|im_start|>user\nSolve the problem.<|im_end|>\n"


def test_fresh_copy_leaves_the_cached_checkpoint_alone(fsdp_checkpoint, fresh_copy):
    sample = fsdp_checkpoint(SINGLE)
    copy = fresh_copy(sample)
    (copy.role_dir / "fsdp_config.json").unlink()
    assert (sample.role_dir / "fsdp_config.json").is_file() and copy.role_dir != sample.role_dir


BARE = FsdpSpec(with_optimizer=False, with_tokenizer=False, with_generation_config=False)


def test_a_failing_rank_is_reported_and_its_peers_are_killed(tmp_path):
    # Rank 1 cannot save its optimizer state; rank 0 then waits for it in FSDP1's state-dict
    # all-gather until it is killed.
    (tmp_path / "optim_world_size_2_rank_1.pt").mkdir()
    spec = FsdpSpec(fsdp_version=1, with_tokenizer=False, with_generation_config=False)
    with pytest.raises(RuntimeError, match=r"(?s)FSDP rank 1 of 2 \(exit code 1\).*Is a directory"):
        write_fsdp_checkpoint(tmp_path, spec, timeout=120)
    assert not (tmp_path / "model_world_size_2_rank_0.pt").exists()


def test_ranks_past_the_timeout_are_killed(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still running after 0.5 s"):
        write_fsdp_checkpoint(tmp_path, BARE, timeout=0.5)
    assert time.monotonic() - start < 30
    assert not list(tmp_path.glob("model_*.pt"))
