"""Options Dagster's run config lacked before the one schema: set there, they merge as the CLI's flags do."""

from __future__ import annotations

import dagster as dg

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.dagster.helpers import materialize
from merge_pipeline_tests.dagster.test_dagster_failures import assert_nothing_published, failure
from merge_pipeline_tests.helpers import config_says_tied, error_lines, load_safetensors_dir, run_cli, same_bits

UNTIED = FsdpSpec()  # a trained lm_head that differs from the embeddings
KEY = "run/global_step_2/actor"


def test_untie_word_embedding_in_the_run_config_merges_as_the_cli_flag(
    capsys, fsdp_checkpoint, roots, instance, tmp_path
):
    role_dir = roots.drop(fsdp_checkpoint(UNTIED), "run/global_step_2")
    config_says_tied(role_dir)  # tying would drop the trained lm_head: refused unless untied
    roots.track(role_dir, 2)  # the trainer's tracker, after the save as edited
    cli_dir = tmp_path / "cli"
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", role_dir, "--target_dir", cli_dir, "--no-progress", "--untie-word-embedding"
    )
    assert code == 0, err

    result = materialize(instance, roots.settings(), KEY, merge_config={"untie_word_embedding": True})

    assert result.success
    target = roots.target(KEY)
    assert (target / "config.json").read_bytes() == (cli_dir / "config.json").read_bytes()
    merged, by_cli = load_safetensors_dir(target), load_safetensors_dir(cli_dir)
    assert "lm_head.weight" in merged and set(merged) == set(by_cli)
    for name, tensor in by_cli.items():
        assert same_bits(merged[name], tensor), name


def test_without_untie_the_run_fails_naming_the_run_config_field(capsys, fsdp_checkpoint, roots, instance, tmp_path):
    role_dir = roots.drop(fsdp_checkpoint(UNTIED), "run/global_step_2")
    config = config_says_tied(role_dir)
    roots.track(role_dir, 2)
    code, _, err = run_cli(capsys, "merge", "--local_dir", role_dir, "--target_dir", tmp_path / "cli", "--no-progress")
    [cli_line] = error_lines(err)
    assert code == 1 and "--untie-word-embedding" in cli_line

    result = materialize(instance, roots.settings(), KEY)

    step, description = failure(result)
    assert step == "hf_model" and description.startswith(f"{config}: tie_word_embeddings is true")
    assert description == cli_line.removeprefix("error: ").replace("--untie-word-embedding", "untie_word_embedding")
    assert_nothing_published(instance, roots)


def test_backend_in_the_run_config_reads_the_checkpoint_as_that_format(
    capsys, fsdp_checkpoint, roots, instance, tmp_path
):
    role_dir = roots.drop(fsdp_checkpoint(UNTIED), "run/global_step_2", tracker=2)
    code, _, err = run_cli(
        capsys, "merge", "--local_dir", role_dir, "--target_dir", tmp_path / "cli", "--backend", "megatron"
    )
    [cli_line] = error_lines(err)
    assert code == 1 and cli_line.startswith(f"error: {role_dir}/huggingface: no model weights")

    result = materialize(instance, roots.settings(), KEY, merge_config={"backend": "megatron"})

    assert failure(result) == ("hf_model", cli_line.removeprefix("error: "))
    assert_nothing_published(instance, roots)


def test_tie_and_untie_together_fail_in_one_line(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(UNTIED), "run/global_step_2", tracker=2)

    result = materialize(
        instance, roots.settings(), KEY, merge_config={"tie_word_embedding": True, "untie_word_embedding": True}
    )

    assert failure(result) == ("hf_model", "tie_word_embedding and untie_word_embedding contradict each other")
    assert_nothing_published(instance, roots)


def test_fp8_in_the_run_config_merges_as_the_cli_flag_and_passes_the_checks(
    capsys, fsdp_checkpoint, roots, instance, tmp_path
):
    role_dir = roots.drop(fsdp_checkpoint(UNTIED), "run/global_step_2", tracker=2)
    flags = {"dtype": "fp8", "fp8_block_size": 32}
    cli_flags = ("--dtype", "fp8", "--fp8-block-size", "32")
    code, _, err = run_cli(capsys, "merge", "--local_dir", role_dir, "--target_dir", tmp_path / "cli", *cli_flags)
    assert code == 0, err

    result = materialize(instance, roots.settings(), KEY, merge_config=flags)

    assert result.success  # the folder checks (transformers loads it on the meta device) passed
    target = roots.target(KEY)
    assert (target / "config.json").read_bytes() == (tmp_path / "cli" / "config.json").read_bytes()
    merged, by_cli = load_safetensors_dir(target), load_safetensors_dir(tmp_path / "cli")
    assert set(merged) == set(by_cli) and any(name.endswith("weight_scale_inv") for name in merged)
    for name, tensor in by_cli.items():
        assert same_bits(merged[name], tensor), name
    [materialization] = [
        m for m in result.asset_materializations_for_node("hf_model") if m.asset_key == dg.AssetKey("parallel_config")
    ]
    assert materialization.metadata["fp8"].data["quantized_weights"] == 14


def test_fp8_that_would_quantize_nothing_fails_as_the_cli_does(capsys, fsdp_checkpoint, roots, instance, tmp_path):
    """The demo's model is off the 128 grid: the run fails with the CLI's line in run config words (the
    refusal is made where the fp8 plan is), and nothing, no quantization_config, is written."""
    role_dir = roots.drop(fsdp_checkpoint(UNTIED), "run/global_step_2", tracker=2)
    code, _, err = run_cli(capsys, "merge", "--local_dir", role_dir, "--target_dir", tmp_path / "cli", "--dtype", "fp8")
    [cli_line] = error_lines(err)
    assert code == 1 and "would quantize nothing" in cli_line

    result = materialize(instance, roots.settings(), KEY, merge_config={"dtype": "fp8"})

    step, description = failure(result)
    assert step == "hf_model" and description == cli_line.removeprefix("error: ").replace(
        "--fp8-block-size", "fp8_block_size"
    ).replace("--dtype", "dtype")
    assert description.endswith(
        "pass fp8_block_size 32 (it divides all their dimensions) or another dtype (e.g. bfloat16)"
    )
    assert_nothing_published(instance, roots)
    assert not roots.output.exists()
