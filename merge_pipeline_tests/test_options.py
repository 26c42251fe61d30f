"""One options schema: every ``MergeOptions`` field is a CLI flag and a Dagster run-config field, alike."""

from __future__ import annotations

import argparse
import re

import pytest

from merge_pipeline.cli import _options, build_parser
from merge_pipeline.dagster.averaged_model import Averaging
from merge_pipeline.dagster.run_config import MergeConfig
from merge_pipeline.errors import MergeError
from merge_pipeline.options import BACKENDS, OPTION_FIELDS, MergeOptions, cli_flags, option_field
from merge_pipeline.pipeline.prepare import prepare
from merge_pipeline.ray_settings import RAY_FIELDS
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.dagster.helpers import PROJECT_ROOT

LAUNCHER_FIELDS = {"launcher", "nproc_per_node", "nnodes", "rdzv_endpoint"}  # Dagster's own
RAY_CONFIG_FIELDS = {f"ray_{setting.name}" for setting in RAY_FIELDS}  # the CLI's --ray-<name>


def command_flags(command: str) -> dict[str, argparse.Action]:
    """The real parser's actions of one subcommand, by destination."""
    [commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return {action.dest: action for action in commands.choices[command]._actions}


def test_every_option_is_a_merge_flag_with_its_help_and_default():
    flags = command_flags("merge")
    for option in OPTION_FIELDS:
        action = flags[option.name]
        assert action.option_strings == list(cli_flags(option)), option.name
        assert action.help == option.metadata["help"] and action.help, option.name
        assert action.default == option.default, option.name
        assert action.choices == option.metadata["choices"], option.name


def test_every_option_is_a_dagster_config_field_with_the_same_description_and_default():
    config_fields = MergeConfig.model_fields
    assert set(config_fields) == {option.name for option in OPTION_FIELDS} | LAUNCHER_FIELDS | RAY_CONFIG_FIELDS
    for option in OPTION_FIELDS:
        default = list(option.default) if isinstance(option.default, tuple) else option.default  # Dagster's lists
        assert config_fields[option.name].default == default, option.name
        assert config_fields[option.name].description == option.metadata["help"], option.name
    for setting in RAY_FIELDS:
        field = config_fields[f"ray_{setting.name}"]
        assert field.default == setting.default and setting.metadata["help"] in field.description, setting.name
    every_option_set = {
        "backend": "fsdp",
        "tie_word_embedding": True,
        "is_value_model": True,
        "trust_remote_code": True,
        "dtype": "bfloat16",  # what --quantize writes its unquantized tensors in
        "fp8_block_size": 64,
        "quantize": "W4A16",
        "quantize_ignore": ["lm_head", "re:.*mlp.gate$"],
        "merge_lora": True,
        "hf_model_path": "/models/base",
        "verify_replicas": True,
        "max_shard_size": "1GB",
        "overwrite": True,
        "max_side_file_size": "1MB",
    }
    assert set(every_option_set) | {"untie_word_embedding"} == {option.name for option in OPTION_FIELDS}
    assert MergeConfig(**every_option_set, launcher="torchrun").options() == MergeOptions(**every_option_set)


def test_averaging_knobs_are_the_options_in_the_cli_and_in_dagster():
    """The accumulation dtype: one default, one set of choices, one help in ``average`` and ``averaging:``;
    the output dtype's default and choices are the merge's."""
    accumulate, dtype = option_field("average_accumulate"), option_field("dtype")
    flag = command_flags("average")["accumulate"]
    setting = Averaging.model_fields["accumulate"]
    assert (flag.default, flag.choices) == (accumulate.default, accumulate.metadata["choices"])
    assert flag.help.startswith(accumulate.metadata["help"] + " (default float32)")
    assert (setting.default, setting.description) == (accumulate.default, accumulate.metadata["help"])
    assert Averaging(accumulate="float64").accumulate == "float64"
    with pytest.raises(ValueError):
        Averaging(accumulate="bfloat16")  # not one of the option's choices
    assert Averaging.model_fields["dtype"].default == dtype.default
    for choice in dtype.metadata["choices"]:
        assert Averaging(dtype=choice).dtype == choice


@pytest.mark.parametrize("command", ["merge", "average"])
def test_every_ray_setting_is_a_flag_of_each_command_that_writes_a_folder(command):
    """``merge`` and ``average`` write on Ray alike: the flags are those of Dagster's ``ray_*`` fields."""
    ray_flags = {dest: action for dest, action in command_flags(command).items() if dest.startswith("ray_")}
    assert set(ray_flags) == RAY_CONFIG_FIELDS
    assert {dest: action.option_strings for dest, action in ray_flags.items()} == {
        dest: [f"--{dest.replace('_', '-')}"] for dest in RAY_CONFIG_FIELDS
    }


def test_verl_spellings_and_every_earlier_flag_are_kept():
    verl = {"--tie-word-embedding", "--is-value-model", "--trust-remote-code", "--hf_model_path", "--hf-model-path"}
    ours = {"--backend", "--untie-word-embedding", "--dtype", "--merge-lora", "--verify-replicas"}
    spellings = {"merge": set(), "test": set(), "inspect": set()}
    for command, found in spellings.items():
        for action in command_flags(command).values():
            found.update(action.option_strings)
    assert spellings["merge"] >= verl | ours | {
        "--local_dir",
        "--target_dir",
        "--use_cpu_initialization",
        "--max-shard-size",
        "--overwrite",
        "--max-side-file-size",
    }
    assert spellings["test"] >= verl | ours | {"--local_dir", "--use_cpu_initialization", "--test_hf_dir", "--atol"}
    assert spellings["test"].isdisjoint({"--max-shard-size", "--overwrite", "--max-side-file-size"})
    assert spellings["inspect"] == {
        "-h",
        "--help",
        "--backend",
        "--trust-remote-code",
        "--hf_model_path",
        "--hf-model-path",
        "--dtype",  # shows the config.json dtype a merge with it writes
        "--fp8-block-size",
        "--quantize",  # lists what a merge with it would keep unquantized
        "--quantize-ignore",
        "--json",
    }


def test_cli_flags_reach_the_options():
    parser = build_parser()
    args = parser.parse_args(
        ["merge", "--local_dir", "a", "--target_dir", "b", "--backend", "hf", "--untie-word-embedding"]
        + ["--hf-model-path", "/base", "--max-side-file-size", "2MB", "--dtype", "fp8", "--fp8-block-size", "64"]
    )
    assert _options(args) == MergeOptions(
        backend="hf",
        untie_word_embedding=True,
        hf_model_path="/base",
        max_side_file_size="2MB",
        dtype="fp8",
        fp8_block_size=64,
    )


def test_an_unknown_backend_is_refused_in_one_line():
    with pytest.raises(MergeError, match=rf"^--backend must be one of {', '.join(BACKENDS)}, not 'nemo'$"):
        MergeOptions(backend="nemo")


def test_the_engine_opens_the_checkpoint_as_the_options_backend_says(fsdp_checkpoint):
    role_dir = fsdp_checkpoint(FsdpSpec()).role_dir
    with pytest.raises(MergeError, match=f"^{re.escape(str(role_dir))}/huggingface: no model weights"):
        prepare(role_dir, MergeOptions(backend="megatron"))
    with prepare(role_dir, MergeOptions(backend="fsdp")) as prepared:
        assert prepared.plan.backend == "fsdp"


def test_the_dagster_guide_lists_every_run_config_field():
    guide = (PROJECT_ROOT / "docs" / "DAGSTER.md").read_text()
    block = guide.split("**Per-run config**", 1)[1].split("```", 2)[1]
    listed = re.findall(r"^      (\w+):", block, flags=re.MULTILINE)
    assert listed == list(MergeConfig.model_fields)
