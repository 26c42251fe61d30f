"""``merge-pipeline average``: the weighted average of several checkpoints of one model,
written as a merge writes one (streamed, checked, published atomically).

The inputs are real checkpoints written by the sample writers, several seeds of one spec standing for
several steps of one run. The engine accumulates in a fixed order, one correctly rounded operation at a
time, so the output is compared bit for bit with the same float32 (or float64) sum done here with torch
on the reference weights, and within float32 accumulation with the float64 average.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

import pytest
import torch

from merge_pipeline.engine.averaging import AveragedSource
from merge_pipeline.engine.fp8_quantize import quantize_bands
from merge_pipeline.engine.publish import staged_output, staging_path
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.manifest import read_manifest
from merge_pipeline.hub.model_card import render_card
from merge_pipeline.options import MergeOptions, average_weights
from merge_pipeline.pipeline.folder import finish_folder, write_side_files
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.plan import PlannedTensor
from merge_pipeline.workers.writing import resume_key, write_weights
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_samples.megatron import VARIANTS, write_megatron_samples
from merge_pipeline_tests.engine.test_inputs_changed import rewrite_in_place
from merge_pipeline_tests.helpers import (
    assert_bit_exact,
    error_lines,
    load_safetensors_dir,
    merge_ok,
    run_cli,
    same_bits,
    torchrun,
    tree_digest,
)

STEP = FsdpSpec(with_optimizer=False)  # three seeds of it: three steps of one run
MEGATRON_STEP = VARIANTS["llama_tied_pp2"]  # megatron-core's own save: PP=2, bfloat16, tied embeddings


def weighted_sum(
    tensors: list[dict[str, torch.Tensor]], weights: tuple[float, ...], accumulate: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """What the engine computes, in its order: w_0 x_0 + w_1 x_1 + ..., each product and sum rounded to ``accumulate``."""
    out = {}
    for name in tensors[0]:
        total = tensors[0][name].to(accumulate) * weights[0]
        for one, weight in zip(tensors[1:], weights[1:], strict=True):
            total = total + one[name].to(accumulate) * weight
        out[name] = total
    return out


def assert_within_float32_accumulation(
    written: dict[str, torch.Tensor], tensors: list[dict[str, torch.Tensor]], weights: tuple[float, ...]
) -> None:
    """Against the float64 average cast to the written dtype: off by at most the float32 sum's rounding
    (a few ulps of the terms' magnitude) plus one rounding to the written dtype."""
    for name, value in written.items():
        exact = sum(one[name].to(torch.float64) * w for one, w in zip(tensors, weights, strict=True))
        magnitude = sum(one[name].to(torch.float64).abs() * w for one, w in zip(tensors, weights, strict=True))
        bound = 2 * len(tensors) * torch.finfo(torch.float32).eps * magnitude
        bound += torch.finfo(value.dtype).eps * exact.abs() + torch.finfo(value.dtype).tiny
        assert ((value.to(torch.float64) - exact).abs() <= bound).all(), name


def average(capsys, inputs: list[Path], target: Path, *flags) -> tuple[int, str, str]:
    return run_cli(capsys, "average", "--inputs", *inputs, "--target_dir", target, "--no-progress", *flags)


def average_ok(capsys, inputs: list[Path], target: Path, *flags) -> str:
    code, out, err = average(capsys, inputs, target, *flags)
    assert code == 0, err
    return out


def average_error(capsys, inputs: list[Path], target: Path, *flags) -> str:
    code, out, err = average(capsys, inputs, target, *flags)
    assert code == 1 and "averaged" not in out and not target.exists()
    [line] = error_lines(err)
    return line


@pytest.fixture
def steps(fsdp_checkpoint):
    return [fsdp_checkpoint(dataclasses.replace(STEP, seed=seed)) for seed in range(3)]


def references(samples) -> list[dict[str, torch.Tensor]]:
    return [load_safetensors_dir(sample.reference_dir) for sample in samples]


# --- the weights of each scheme (fast) ---------------------------------------------------------------


def test_weights_are_equal_scaled_or_an_exponential_moving_average():
    assert average_weights(4) == (0.25,) * 4
    assert average_weights(3, weights=[1, 1, 2]) == (0.25, 0.25, 0.5)
    ema = average_weights(3, ema=0.5)  # ema_0 = x_0, ema_i = 0.5 ema_{i-1} + 0.5 x_i
    assert ema == (0.25, 0.25, 0.5) and sum(average_weights(7, ema=0.9)) == pytest.approx(1, abs=1e-12)


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ({"weights": [1, 2]}, "--weights: 2 weights for 3 inputs"),
        ({"weights": [1, 0, 2]}, "--weights [1, 0, 2]: every weight must be a positive number"),
        ({"ema": 1.0}, "--ema 1.0: the decay must lie between 0 and 1"),
        ({"weights": [1, 1, 1], "ema": 0.5}, "--weights and --ema contradict each other: give one"),
    ],
)
def test_bad_weights_are_one_line(given, problem):
    with pytest.raises(MergeError, match=f"^{re.escape(problem)}$"):
        average_weights(3, **given)


def test_options_refuse_one_input_a_repeated_input_and_weights_that_do_not_add_up():
    with pytest.raises(MergeError, match="^--inputs: averaging needs at least two checkpoints, got 1$"):
        MergeOptions(average_inputs=("/a",), average_weights=(1.0,))
    with pytest.raises(MergeError, match="^/a: is given twice in --inputs"):
        MergeOptions(average_inputs=("/a", "/a"), average_weights=(0.5, 0.5))
    with pytest.raises(MergeError, match=r"^--weights \[0.5, 0.6\]: expected positive weights summing to 1$"):
        MergeOptions(average_inputs=("/a", "/b"), average_weights=(0.5, 0.6))
    # a torchrun worker's options come back from JSON as lists
    assert MergeOptions(average_inputs=["/a", "/b"], average_weights=[0.5, 0.5]).average_inputs == ("/a", "/b")


@dataclasses.dataclass(frozen=True)
class Pieces:
    """A tensor source cut in pieces of ``piece`` elements, as file reads and built tensors come."""

    tensor: torch.Tensor
    piece: int

    def byte_runs(self) -> None:
        return None

    def pieces(self):
        flat = self.tensor.reshape(-1)
        for start in range(0, flat.numel(), self.piece):
            yield flat[start : start + self.piece].clone()


def source_of(tensors: list[torch.Tensor], cuts: list[int], weights, accumulate=torch.float32) -> AveragedSource:
    planned = tuple(
        PlannedTensor("w", tuple(t.shape), t.dtype, Pieces(t, cut)) for t, cut in zip(tensors, cuts, strict=True)
    )
    paths = tuple(Path(f"/step_{i}") for i in range(len(tensors)))
    return AveragedSource("w", planned, tuple(weights), accumulate, paths)


@pytest.mark.parametrize("accumulate", [torch.float32, torch.float64])
def test_the_sum_does_not_depend_on_how_the_inputs_are_cut(accumulate):
    # more than one 8 MB unit, mixed stored dtypes, pieces that end anywhere
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(2_500_001, generator=generator).to(dtype)
        for dtype in (torch.bfloat16, torch.float32, torch.float16)
    ]
    weights = (0.2, 0.3, 0.5)
    streamed = torch.cat(
        [p.clone() for p in source_of(tensors, [1_000_003, 65_537, 2_500_001], weights, accumulate).pieces()]
    )
    whole = weighted_sum([{"w": t} for t in tensors], weights, accumulate)["w"]
    assert same_bits(streamed, whole)


def test_integer_tensors_are_kept_when_equal_and_refused_when_not():
    counts = torch.arange(3_000_000, dtype=torch.int64)
    kept = torch.cat(
        [p.clone() for p in source_of([counts, counts.clone()], [1_000_000, 999_983], (0.5, 0.5)).pieces()]
    )
    assert same_bits(kept, counts)
    other = counts.clone()
    other[-1] = 0
    with pytest.raises(
        MergeError, match=r"^/step_1: w \(int64\) differs from /step_0's: integer tensors are not averaged$"
    ):
        list(source_of([counts, other], [1_000_000, 999_983], (0.5, 0.5)).pieces())


# --- real checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "weights", "accumulate", "dtype"),
    [
        ((), (1 / 3,) * 3, torch.float32, torch.float32),
        (("--weights", "1", "2", "5", "--dtype", "bfloat16"), (1 / 8, 2 / 8, 5 / 8), torch.float32, torch.bfloat16),
        (("--ema", "0.9", "--accumulate", "float64"), average_weights(3, ema=0.9), torch.float64, torch.float32),
    ],
    ids=["equal", "weights-bf16", "ema-float64"],
)
def test_three_fsdp_steps_average_to_the_weighted_sum_of_their_weights(
    capsys, tmp_path, steps, flags, weights, accumulate, dtype
):
    target = tmp_path / "averaged"
    out = average_ok(capsys, [s.role_dir for s in steps], target, *flags)

    assert out.startswith("averaged 3 checkpoints (weights ")
    written, refs = load_safetensors_dir(target), references(steps)
    expected = {name: t.to(dtype) for name, t in weighted_sum(refs, weights, accumulate).items()}
    assert_bit_exact(written, expected)
    assert_within_float32_accumulation(written, refs, weights)
    manifest = read_manifest(target)
    assert manifest["source"]["backend"] == "average"
    assert [(i["path"], i["backend"]) for i in manifest["source"]["layout"]["averaged_inputs"]] == [
        (str(s.role_dir), "fsdp") for s in steps
    ]
    assert [i["weight"] for i in manifest["source"]["layout"]["averaged_inputs"]] == pytest.approx(weights, abs=1e-15)
    assert manifest["source"]["layout"]["accumulate"] == str(accumulate).removeprefix("torch.")
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(manifest["files"])
    assert json.loads((target / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    card = render_card(manifest, "org/averaged")  # what an upload puts on the Hub
    for sample, weight in zip(steps, weights, strict=True):
        assert f"| `{sample.role_dir}` | fsdp | {weight:.6g} |" in card


@pytest.fixture(scope="module")
def megatron_steps(tmp_path_factory):
    """Three seeds of one Megatron variant, written by megatron-core in one torchrun job."""
    variants = [dataclasses.replace(MEGATRON_STEP, name=f"seed{seed}", seed=seed) for seed in range(3)]
    samples = write_megatron_samples(tmp_path_factory.mktemp("megatron_steps"), variants, timeout=600)
    return [samples[v.name] for v in variants]


@pytest.mark.slow
def test_three_megatron_steps_average_to_the_weighted_sum_of_their_weights(capsys, tmp_path, megatron_steps):
    target = tmp_path / "averaged"
    average_ok(capsys, [s.role_dir for s in megatron_steps], target)

    written, refs = load_safetensors_dir(target), references(megatron_steps)
    weights = (1 / 3,) * 3
    expected = {name: t.to(refs[-1][name].dtype) for name, t in weighted_sum(refs, weights).items()}
    assert_bit_exact(written, expected)  # each tensor in its stored dtype (bfloat16 here, fp32 where stored so)
    assert_within_float32_accumulation(written, refs, weights)
    config = json.loads((target / "config.json").read_text())
    assert config["tie_word_embeddings"] and "lm_head.weight" not in written


def test_a_merged_folder_averages_as_the_checkpoint_it_was_merged_from(capsys, tmp_path, steps):
    merged = tmp_path / "merged_step_1"
    merge_ok(capsys, steps[0].role_dir, merged)
    from_checkpoints, mixed = tmp_path / "from_checkpoints", tmp_path / "mixed"
    average_ok(capsys, [steps[0].role_dir, steps[1].role_dir], from_checkpoints)
    average_ok(capsys, [merged, steps[1].role_dir], mixed)

    ours, theirs = tree_digest(from_checkpoints), tree_digest(mixed)
    del ours["merge_manifest.json"], theirs["merge_manifest.json"]  # they name their inputs
    assert ours == theirs
    inputs = read_manifest(mixed)["source"]["layout"]["averaged_inputs"]
    assert [(i["path"], i["backend"]) for i in inputs] == [(str(merged), "hf"), (str(steps[1].role_dir), "fsdp")]


def test_an_average_names_every_input_and_their_run_and_steps(capsys, caplog, tmp_path, steps):
    """Its log line names each input; its card the run and the steps the inputs were merged from."""
    caplog.set_level(logging.INFO, logger="merge_pipeline")
    merged = [tmp_path / "out" / "run_a" / f"global_step_{step}" / "actor" for step in (10, 20)]
    for sample, folder in zip(steps, merged, strict=False):
        merge_ok(capsys, sample.role_dir, folder)

    average_ok(capsys, merged, tmp_path / "averaged")

    assert f"averaged {merged[0]}, {merged[1]} -> {tmp_path / 'averaged'}: " in caplog.text
    card = render_card(read_manifest(tmp_path / "averaged"), "org/averaged")
    assert "| run | `run_a` |" in card and "| steps | 10, 20 |" in card


def test_other_shapes_are_one_line_naming_the_first_difference(capsys, tmp_path, steps, fsdp_checkpoint):
    other = fsdp_checkpoint(dataclasses.replace(STEP, seed=1, vocab_size=1004)).role_dir
    line = average_error(capsys, [steps[0].role_dir, other, steps[2].role_dir], tmp_path / "averaged")
    assert line == (
        f"error: {other}: model.embed_tokens.weight has shape [1004, 64], [1003, 64] in {steps[2].role_dir}:"
        " averaging needs one architecture"
    )


def test_a_target_inside_any_input_is_refused_before_any_work(capsys, steps):
    target = steps[0].role_dir / "averaged"
    line = average_error(capsys, [s.role_dir for s in steps], target)
    assert (
        line
        == f"error: {target}: lies inside the input checkpoint {steps[0].role_dir}: choose a --target_dir outside it"
    )


@pytest.mark.parametrize(
    "spec",
    [dataclasses.replace(STEP, critic=True), dataclasses.replace(STEP, tie_word_embeddings=True)],
    ids=["value-model", "tied"],
)
def test_value_models_and_tied_embeddings_average_as_their_merges(capsys, tmp_path, fsdp_checkpoint, spec):
    inputs = [fsdp_checkpoint(dataclasses.replace(spec, seed=seed)).role_dir for seed in range(2)]
    merges = []
    for index, role_dir in enumerate(inputs):
        merges.append(tmp_path / f"merged_{index}")
        merge_ok(capsys, role_dir, merges[-1])
    target = tmp_path / "averaged"
    average_ok(capsys, inputs, target)

    expected = weighted_sum([load_safetensors_dir(m) for m in merges], (0.5, 0.5))
    assert_bit_exact(target, {name: t.to(torch.float32) for name, t in expected.items()})
    assert json.loads((target / "config.json").read_text()) == json.loads((merges[-1] / "config.json").read_text())


def test_lora_adapters_are_refused_and_their_folded_weights_averaged(capsys, tmp_path, fsdp_checkpoint):
    inputs = [fsdp_checkpoint(dataclasses.replace(STEP, lora=(8, 16), seed=seed)).role_dir for seed in range(2)]
    line = average_error(capsys, inputs, tmp_path / "refused")
    assert line == (
        f"error: {inputs[0]}: holds a LoRA adapter: averaging its A and B matrices is not averaging its updates;"
        " pass --merge-lora to average the folded weights"
    )

    folded = [tmp_path / "folded_0", tmp_path / "folded_1"]
    for role_dir, merged in zip(inputs, folded, strict=True):
        merge_ok(capsys, role_dir, merged, "--merge-lora")
    target = tmp_path / "averaged"
    average_ok(capsys, inputs, target, "--merge-lora")
    assert_bit_exact(target, weighted_sum([load_safetensors_dir(f) for f in folded], (0.5, 0.5)))

    merged_adapter = tmp_path / "with_adapter"
    merge_ok(capsys, inputs[0], merged_adapter)  # base weights + lora_adapter/
    line = average_error(capsys, [merged_adapter, folded[1]], tmp_path / "refused")
    assert line.startswith(f"error: {merged_adapter / 'lora_adapter'}: a LoRA adapter beside the base weights")


def test_fp8_quantizes_the_float32_average(capsys, tmp_path, steps):
    target = tmp_path / "averaged"
    average_ok(capsys, [s.role_dir for s in steps[:2]], target, "--dtype", "fp8", "--fp8-block-size", "32")

    average32 = weighted_sum(references(steps[:2]), (0.5, 0.5))
    written = load_safetensors_dir(target)
    quantized = [name for name, t in written.items() if t.dtype == torch.float8_e4m3fn]
    assert quantized and all(name.endswith("proj.weight") for name in quantized)
    for name in quantized:
        weight, scale_inv = quantize_bands(average32[name], 32)
        assert same_bits(written[name], weight) and same_bits(written[name + "_scale_inv"], scale_inv), name
    for name, t in average32.items():
        if name not in quantized:
            assert same_bits(written[name], t.to(torch.bfloat16)), name
    assert read_manifest(target)["decisions"]["fp8"]["quantized_weights"] == len(quantized)


def test_the_resume_key_covers_every_input_and_weight(fresh_copy, steps):
    copies = [fresh_copy(sample).role_dir for sample in steps]
    options = MergeOptions(average_inputs=tuple(map(str, copies)), average_weights=(1 / 3,) * 3)

    def key(options: MergeOptions) -> str:
        with prepare(copies[-1], options) as prepared:
            return resume_key(prepared, options)

    before = key(options)
    assert key(dataclasses.replace(options, average_weights=(0.25, 0.25, 0.5))) != before
    rank_file = next(copies[0].glob("model_world_size_*_rank_0.pt"))  # the oldest input: not the one configs come from
    os.utime(rank_file, ns=(rank_file.stat().st_atime_ns, rank_file.stat().st_mtime_ns + 1))
    assert key(options) != before


@pytest.mark.torchrun
def test_torchrun_ranks_write_the_same_average(capsys, tmp_path, steps):
    inputs = [s.role_dir for s in steps]
    average_ok(capsys, inputs, tmp_path / "single", "--max-shard-size", "200KB", "--dtype", "bfloat16")
    flags = ("--max-shard-size", "200KB", "--dtype", "bfloat16", "--no-progress")
    with torchrun(2, "--inputs", *inputs, "--target_dir", tmp_path / "multi", *flags, command="average") as run:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert "rank 1/2 writes" in err
    assert tree_digest(tmp_path / "multi") == tree_digest(tmp_path / "single")
    assert len(list((tmp_path / "single").glob("model-*.safetensors"))) > 2


def test_any_input_rewritten_during_the_average_is_refused_and_nothing_published(tmp_path, fresh_copy, steps):
    copies = [fresh_copy(sample).role_dir for sample in steps]
    options = MergeOptions(average_inputs=tuple(map(str, copies)), average_weights=(1 / 3,) * 3)
    target, rank_file = tmp_path / "out", copies[0] / "model_world_size_2_rank_1.pt"  # not the reference input
    with pytest.raises(MergeError) as refused:
        with (
            prepare(copies[-1], options) as prepared,
            staged_output(target, source=copies[-1], overwrite=False) as staging,
        ):
            write_side_files(prepared, staging, options)
            report = write_weights(prepared.outputs, staging, show_progress=False)
            rewrite_in_place(rank_file)
            finish_folder(prepared, staging, options, report)
    assert str(refused.value) == f"{rank_file}: changed while it was being merged: re-run once the save is complete"
    assert not target.exists() and not staging_path(target).exists()
