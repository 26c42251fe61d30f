"""The merge options, described once: the CLI's flags and Dagster's run config are both built from ``MergeOptions``.

Each field carries its help text, choices and the CLI commands that take it as metadata (``settings.described``: the
one way a knob is described, ``RaySettings``' too); ``OPTION_FIELDS`` lists them in order. Dagster's
``hf_model`` takes them all; its ``averaging:`` setting takes averaging's from here (``option_field``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import Field, dataclass, fields

from merge_pipeline.errors import MergeError, shown
from merge_pipeline.settings import described, parse_size

BACKENDS = ("auto", "fsdp", "megatron", "hf", "deepspeed", "dcp")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp8")
AS_BASE = "as-base"  # --quantize: the base model's own quantized format
# Larger than any real tokenizer.json (~30 MB), small enough that a stray dump is noticed.
DEFAULT_MAX_SIDE_FILE_SIZE = "64MB"
READING = ("merge", "test", "inspect")  # how to open the checkpoint: every command
TENSORS = ("merge", "test")  # what tensors come out: also compared by `test`
FOLDER = ("merge",)  # how the folder is written
AVERAGE = ("average",)  # averaging: set by the `average` command and Dagster's averaged_model, no merge flag
ACCUMULATE_CHOICES = ("float32", "float64")


def _option(default, help: str, *, commands=TENSORS, choices: tuple[str, ...] | None = None, **cli):
    """A field of ``MergeOptions``, taken by the CLI ``commands``."""
    return described(default, help, commands=commands, choices=choices, **cli)


@dataclass(frozen=True)
class MergeOptions:
    """What the user asked for; the same fields back the CLI flags and the Dagster run config."""

    backend: str = _option("auto", "checkpoint format (default: detect)", commands=READING, choices=BACKENDS)
    tie_word_embedding: bool = _option(False, "tie lm_head to the embeddings (also read from config.json)")
    untie_word_embedding: bool = _option(
        False,
        "keep a trained lm_head that differs from the embeddings; config.json then says tie_word_embeddings false",
    )
    is_value_model: bool = _option(False, "a critic / value model (also detected from the checkpoint)")
    trust_remote_code: bool = _option(False, "allow config.json to name remote-code classes", commands=READING)
    # auto = keep each tensor's stored dtype: never lose precision unasked; inspect shows config.json's dtype
    dtype: str = _option(
        "auto",
        "output dtype (default auto: keep each tensor's stored dtype; config.json names the widest, see docs/LAYOUTS.md;"
        " fp8: linear weights block-quantized to float8_e4m3fn, the rest bfloat16)",
        commands=READING,  # inspect --dtype fp8 also lists what would stay unquantized
        choices=DTYPE_CHOICES,
    )
    fp8_block_size: int = _option(
        128, "--dtype fp8: rows and columns of each tile sharing one scale (default 128)", commands=READING
    )
    quantize: str | None = _option(
        None,
        "write the linear weights in a compressed-tensors format that needs no calibration data, byte for byte what"
        " llm-compressor's model_free_ptq writes: W4A16, W4A16_ASYM, W8A16, FP8_DYNAMIC, FP8_BLOCK, NVFP4A16, MXFP4A16,"
        " MXFP8A16 (the rest bfloat16; needs the [quant] extra; see docs/LAYOUTS.md); as-base: the format the base"
        " model's quantization_config states (--hf_model_path's, else the checkpoint's config.json): its"
        " compressed-tensors group, fp8 blocks or gpt-oss's mxfp4 experts",
        commands=READING,  # inspect --quantize also lists what would stay unquantized
        metavar="SCHEME",
    )
    quantize_ignore: tuple[str, ...] = _option(
        (),
        "--quantize: modules kept unquantized, llm-compressor's syntax (a module name or re:PATTERN); default: the"
        " embeddings, heads, MoE routers and vision / audio towers",
        commands=READING,
        metavar="NAME",
        nargs="+",
    )
    merge_lora: bool = _option(False, "fold LoRA into the base weights instead of writing lora_adapter/")
    hf_model_path: str | None = _option(
        None,
        "the original HF model folder (the trainer's model.path): config, tokenizer and LoRA base weights when the checkpoint holds none",
        commands=READING,
        flags=("--hf_model_path", "--hf-model-path"),  # verl's spelling first
        metavar="DIR",
    )
    verify_replicas: bool = _option(False, "check that replica groups of a 2-D mesh hold identical bytes")
    max_shard_size: str | int = _option("5GB", "largest safetensors shard, HF-style (default 5GB)", commands=FOLDER)
    overwrite: bool = _option(False, "replace an existing target once the new one is complete", commands=FOLDER)
    max_side_file_size: str | int = _option(
        DEFAULT_MAX_SIDE_FILE_SIZE,
        f"largest file copied from huggingface/ (tokenizer, templates, ...), HF-style (default {DEFAULT_MAX_SIDE_FILE_SIZE})",
        commands=FOLDER,
    )

    # Averaging: a merge of several inputs whose every floating tensor is their weighted
    # average. Carried by the options so every launcher's workers plan the same average.
    average_inputs: tuple[str, ...] = _option(
        (), "the checkpoints (role folders or merged HF folders) to average, oldest first", commands=AVERAGE
    )
    average_weights: tuple[float, ...] = _option((), "one weight per input, summing to 1", commands=AVERAGE)
    average_accumulate: str = _option(
        "float32", "dtype the weighted sum is accumulated in", commands=AVERAGE, choices=ACCUMULATE_CHOICES
    )

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise MergeError(None, f"--backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise MergeError(None, f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, not {self.dtype!r}")
        if self.fp8_block_size < 1:
            raise MergeError(None, f"--fp8-block-size must be a positive number, not {self.fp8_block_size}")
        object.__setattr__(self, "quantize_ignore", tuple(str(n) for n in self.quantize_ignore))
        if self.quantize is not None and self.dtype not in ("auto", "bfloat16"):
            raise MergeError(None, f"--quantize writes its unquantized tensors in bfloat16: drop --dtype {self.dtype}")
        if self.quantize_ignore and self.quantize is None:
            raise MergeError(None, "--quantize-ignore given without --quantize")
        if self.tie_word_embedding and self.untie_word_embedding:
            raise MergeError(None, "--tie-word-embedding and --untie-word-embedding contradict each other")
        parse_size(self.max_shard_size, "--max-shard-size")  # checked before any work, not after the plan
        parse_size(self.max_side_file_size, "--max-side-file-size")
        # tuples, also when the fields come back from JSON (a torchrun worker's options) as lists
        object.__setattr__(self, "average_inputs", tuple(str(p) for p in self.average_inputs))
        object.__setattr__(self, "average_weights", tuple(float(w) for w in self.average_weights))
        if self.average_inputs or self.average_weights:
            _check_average(self.average_inputs, self.average_weights, self.average_accumulate)


def _check_average(inputs: tuple[str, ...], weights: tuple[float, ...], accumulate: str) -> None:
    if len(inputs) < 2:
        raise MergeError(None, f"--inputs: averaging needs at least two checkpoints, got {len(inputs)}")
    if len(set(inputs)) != len(inputs):
        twice = next(p for p in inputs if inputs.count(p) > 1)
        raise MergeError(twice, "is given twice in --inputs: give each checkpoint once (--weights weighs them)")
    if len(weights) != len(inputs):
        raise MergeError(None, f"--weights: {len(weights)} weights for {len(inputs)} inputs")
    if not all(math.isfinite(w) and w > 0 for w in weights) or abs(math.fsum(weights) - 1) > 1e-9:
        raise MergeError(None, f"--weights {list(weights)}: expected positive weights summing to 1")
    if accumulate not in ACCUMULATE_CHOICES:
        raise MergeError(None, f"--accumulate must be one of {', '.join(ACCUMULATE_CHOICES)}, not {accumulate!r}")


MAX_AVERAGED = 10_000  # checkpoints averaged at once: far more steps than a run keeps, weights a small tuple
# How ``average_weights`` weighs the inputs, in the words of the CLI's flags and of Dagster's averaging setting.
GIVEN_WEIGHTS = "one weight per input, oldest first, scaled to sum to 1"
EMA_WEIGHTS = "exponential moving average started at the oldest input: the newest weighs 1 - the decay"


def average_weights(
    count: int, *, weights: Sequence[float] | None = None, ema: float | None = None
) -> tuple[float, ...]:
    """The weights of ``count`` inputs (oldest first): uniform; ``weights`` scaled to sum to 1; or the
    exponential moving average with decay ``ema`` started at the oldest input (the newest weighs ``1 - ema``)."""
    if count > MAX_AVERAGED:
        raise MergeError(None, f"averaging {count} checkpoints: at most {MAX_AVERAGED:,} are averaged at once")
    if weights is not None and ema is not None:
        raise MergeError(None, "--weights and --ema contradict each other: give one")
    if weights is not None:
        if len(weights) != count:
            raise MergeError(None, f"--weights: {len(weights)} weights for {count} inputs")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise MergeError(None, f"--weights {shown(list(weights))}: every weight must be a positive number")
        try:
            total = math.fsum(weights)
        except OverflowError:  # 1e308 + 1e308
            total = math.inf
        if not math.isfinite(total):
            raise MergeError(
                None,
                f"--weights {shown(list(weights))}: their sum overflows: scale them down (only their ratios count)",
            )
        return tuple(w / total for w in weights)
    if ema is not None:
        if not 0 < ema < 1:
            raise MergeError(None, f"--ema {ema}: the decay must lie between 0 and 1")
        # ema_0 = x_0, ema_i = ema * ema_{i-1} + (1 - ema) * x_i: the oldest keeps ema^(K-1)
        return tuple(ema ** (count - 1) if i == 0 else (1 - ema) * ema ** (count - 1 - i) for i in range(count))
    return (1 / count,) * count


# The options of one merge (CLI flags, hf_model's run config); averaging's are set by its own command and asset.
OPTION_FIELDS = tuple(option for option in fields(MergeOptions) if option.metadata["commands"] != AVERAGE)


def cli_flags(option: Field) -> tuple[str, ...]:
    """The CLI spellings of an option field: ``--max-shard-size`` for ``max_shard_size``, unless it names its own."""
    return option.metadata.get("flags") or ("--" + option.name.replace("_", "-"),)


def option_field(name: str) -> Field:
    """The ``MergeOptions`` field ``name``, for a schema that takes the knob under another name."""
    return next(f for f in fields(MergeOptions) if f.name == name)


def options_of(command: str) -> list[Field]:
    """The option fields the CLI command ``command`` takes."""
    return [option for option in OPTION_FIELDS if command in option.metadata["commands"]]
