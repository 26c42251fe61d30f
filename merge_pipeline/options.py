"""What the user asks of a merge: one description for the CLI, the Dagster run config and the readers."""

from __future__ import annotations

from dataclasses import dataclass

from merge_pipeline.errors import MergeError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
# Larger than any real tokenizer.json (~30 MB), small enough that a stray dump is noticed.
DEFAULT_MAX_SIDE_FILE_SIZE = "64MB"


@dataclass(frozen=True)
class MergeOptions:
    """What the user asked for; the same fields back the CLI flags and the Dagster run config."""

    dtype: str = "auto"  # auto = keep each tensor's stored dtype: never lose precision unasked
    max_shard_size: str | int = "5GB"
    merge_lora: bool = False
    tie_word_embedding: bool = False  # force tying even if config.json does not say so
    untie_word_embedding: bool = False  # keep lm_head.weight and write tie_word_embeddings false
    is_value_model: bool = False  # force the value-model (critic) layout
    trust_remote_code: bool = False
    verify_replicas: bool = False
    overwrite: bool = False
    hf_model_path: str | None = None  # original HF model folder: config/tokenizer when the checkpoint has none
    max_side_file_size: str | int = DEFAULT_MAX_SIDE_FILE_SIZE  # each file copied from huggingface/

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise MergeError(None, f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, not {self.dtype!r}")
        if self.tie_word_embedding and self.untie_word_embedding:
            raise MergeError(None, "--tie-word-embedding and --untie-word-embedding contradict each other")
