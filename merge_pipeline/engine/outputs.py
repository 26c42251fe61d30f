"""Decide what gets written: output names, dtypes, tied/critic/LoRA handling and the shard split."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory

from merge_pipeline.engine.lora_merge import split_lora
from merge_pipeline.engine.safetensors_writer import OutputTensor, build_header
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.config import ModelConfig
from merge_pipeline.hf.fp8 import Fp8Decisions
from merge_pipeline.hf.lora import ADAPTER_FILE, LORA_META, OUTPUT_ADAPTER_DIR, has_lora_tensors
from merge_pipeline.hf.quantization import QuantDecisions
from merge_pipeline.hf.safetensors import MAX_HEADER_BYTES, METADATA_KEY, exact_common_dtype
from merge_pipeline.options import DTYPE_CHOICES, MergeOptions
from merge_pipeline.plan import CheckpointPlan, LoraInfo, PlannedTensor, TensorSource
from merge_pipeline.settings import parse_size

# fp8 is no cast: engine/fp8_quantize.py rewrites the plan (tensors are planned here in their stored dtype first).
DTYPES = {name: getattr(torch, name) for name in DTYPE_CHOICES if name not in ("auto", "fp8")}
WEIGHTS_PATTERN = "model{suffix}.safetensors"
ADAPTER_WEIGHTS = f"{OUTPUT_ADAPTER_DIR}/{ADAPTER_FILE}"
# A quantized format's writer: a weight's leading output and the followers written right after it, else None.
Quantized = Callable[[PlannedTensor], "tuple[OutputTensor, tuple[OutputTensor, ...]] | None"]


@dataclass(frozen=True)
class ShardFile:
    filename: str
    tensors: tuple[OutputTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class OutputPlan:
    """The complete list of files and tensors to write, fixed before a byte is written."""

    shards: list[ShardFile]
    adapter: ShardFile | None
    lora: LoraInfo | None
    lora_targets: list[str]
    tied: bool
    is_value_model: bool
    config_dtype: torch.dtype
    dropped: list[str] = field(default_factory=list)  # e.g. a tied lm_head.weight
    adapter_only: bool = False  # no base weights: the folder is a PEFT adapter, not a model
    fp8: Fp8Decisions | None = None  # --dtype fp8: what was quantized and what kept (engine/fp8_quantize.py)
    quantization: QuantDecisions | None = (
        None  # --quantize: the scheme, what was quantized and kept (engine/quantize.py)
    )

    @property
    def files(self) -> list[ShardFile]:
        return self.shards + ([self.adapter] if self.adapter else [])

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    @property
    def planned_tensors(self) -> list[PlannedTensor]:
        """The model's tensors as planned (source names and dtypes), the adapter's left out."""
        return [t.planned for shard in self.shards for t in shard.tensors]


def plan_outputs(plan: CheckpointPlan, config: ModelConfig, options: MergeOptions) -> OutputPlan:
    if not plan.tensors:
        raise MergeError(plan.role_dir, "checkpoint holds no tensors")
    tensors = plan.tensors
    adapter: list[PlannedTensor] = []
    targets: list[str] = []
    lora = plan.lora
    if has_lora_tensors(tensors):
        if lora is None:
            raise MergeError(
                plan.role_dir / LORA_META, f"LoRA tensors in the checkpoint but no {LORA_META} with r and lora_alpha"
            )
        split = split_lora(tensors, lora, merge=options.merge_lora, where=plan.role_dir)
        tensors, adapter, targets = split.base, split.adapter, split.target_modules
    elif options.merge_lora:
        raise MergeError(plan.role_dir, "--merge-lora given but the checkpoint has no LoRA tensors")

    is_value_model = plan.writes_value_model(options)
    if (
        options.is_value_model
        and not plan.is_value_model
        and any(t.name.endswith(config.lm_head_name) for t in tensors)
    ):
        raise MergeError(
            plan.role_dir, "--is-value-model given but the checkpoint has lm_head.weight and no value head (score.*)"
        )
    tied = (
        not is_value_model
        and not options.untie_word_embedding
        and (options.tie_word_embedding or config.tie_word_embeddings)
    )
    if tied:
        reason, where = (
            ("--tie-word-embedding given", plan.role_dir)
            if options.tie_word_embedding
            else ("tie_word_embeddings is true", config.path)
        )
        _check_tied_head_is_the_embedding(tensors, config.lm_head_name, reason, where)
    elif options.untie_word_embedding and not any(t.name == config.lm_head_name for t in tensors):
        raise MergeError(
            plan.role_dir, f"--untie-word-embedding given but the checkpoint has no {config.lm_head_name} to keep"
        )
    dropped = [t.name for t in tensors if tied and t.name == config.lm_head_name]
    tensors = [t for t in tensors if t.name not in dropped]

    requested = DTYPES.get(options.dtype)
    model = [OutputTensor(t, _output_dtype(t, requested)) for t in tensors]
    adapter_out = [OutputTensor(t, _output_dtype(t, requested)) for t in adapter]
    adapter_only = not model  # checkpoint.save_lora_only and no --hf_model_path to take the base from
    shards = _split_shards(model, options.max_shard_size) if model else []
    adapter_file = (
        ShardFile(ADAPTER_FILE if adapter_only else ADAPTER_WEIGHTS, tuple(adapter_out)) if adapter_out else None
    )
    for files in (shards, [adapter_file] if adapter_file else []):
        _refuse_what_safetensors_would(files, plan.role_dir)
    return OutputPlan(
        shards=shards,
        adapter=adapter_file,
        lora=lora if adapter_out or options.merge_lora else None,
        lora_targets=targets,
        tied=tied,
        is_value_model=is_value_model,
        config_dtype=auto_config_dtype(t.dtype for t in model or adapter_out),
        dropped=dropped,
        adapter_only=adapter_only,
    )


def _refuse_what_safetensors_would(files: list[ShardFile], where: Path) -> None:
    """Only files every safetensors loader opens: each name once (in the model or the adapter), no
    tensor named like the header's reserved ``__metadata__`` entry, each header within the library's limit."""
    seen: set[str] = set()
    for shard in files:
        for t in shard.tensors:
            name = t.planned.name
            if name == METADATA_KEY:
                raise MergeError(where, f"a tensor is named {METADATA_KEY!r}, which safetensors reserves: refused")
            if name in seen:
                raise MergeError(where, f"two tensors are named {name!r}: a safetensors file holds each name once")
            seen.add(name)
        header = len(build_header(shard.tensors)) - 8
        if header > MAX_HEADER_BYTES:
            raise MergeError(
                where,
                f"{shard.filename}: its header (tensor names) would be {header:,} bytes, over the {MAX_HEADER_BYTES:,} bytes safetensors reads: pass a smaller --max-shard-size",
            )


# Input embedding names, so a tied lm_head can be checked against the tensor it is tied to.
_INPUT_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def _check_tied_head_is_the_embedding(
    tensors: list[PlannedTensor], lm_head_name: str, reason: str, where: Path
) -> None:
    """Tying drops lm_head.weight: allowed only when it holds exactly the embedding's bytes."""
    head = next((t for t in tensors if t.name == lm_head_name), None)
    if head is None:
        return  # nothing to drop
    candidates = sorted((t for t in tensors if t.name.endswith(_INPUT_EMBEDDINGS)), key=lambda t: len(t.name))
    if not candidates:
        raise MergeError(
            where,
            f"{reason} but no input embedding to check {lm_head_name} against; pass --untie-word-embedding to keep {lm_head_name}",
        )
    embedding = candidates[0]
    if not _same_bytes(head, embedding):
        raise MergeError(
            where,
            f"{reason} but {lm_head_name} differs from {embedding.name}: tying would drop trained weights; pass --untie-word-embedding to keep both (config.json then says tie_word_embeddings false)",
        )


def _same_bytes(a: PlannedTensor, b: PlannedTensor) -> bool:
    """Byte-for-byte equality, read piece by piece: never both tensors whole in memory."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    runs = a.source.byte_runs()
    if runs is not None and runs == b.source.byte_runs():
        return True  # the same bytes of the same files: FSDP saves a tied parameter once
    left, right = _byte_pieces(a), _byte_pieces(b)
    x = y = torch.empty(0, dtype=torch.uint8)
    while True:
        # A piece is valid until the next one of the same source is requested: only ask when used up.
        if not len(x):
            x = next(left, None)
        if not len(y):
            y = next(right, None)
        if x is None or y is None:
            return x is None and y is None
        n = min(len(x), len(y))
        if not torch.equal(x[:n], y[:n]):
            return False
        x, y = x[n:], y[n:]


def _byte_pieces(t: PlannedTensor):
    for piece in t.source.pieces():
        if piece.numel():
            yield piece.reshape(-1).view(torch.uint8)


def _output_dtype(t: PlannedTensor, requested: torch.dtype | None) -> torch.dtype:
    # Only floating tensors are cast; integer buffers keep their type.
    if requested is None or not t.dtype.is_floating_point:
        return t.dtype
    return requested


def auto_config_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """config.json's dtype for the dtypes written: the narrowest one that holds every stored floating value exactly.

    transformers' ``from_pretrained(dtype="auto")`` builds every floating parameter in config.json's
    dtype and casts each stored tensor to it, whatever dtype the file says (only a model class's own
    ``_keep_in_fp32_modules`` are exempt). So a mixed checkpoint (bf16 weights, fp32 norms) must say
    float32: a majority dtype would round the exceptions on load.
    """
    widest: torch.dtype | None = None
    for dtype in dtypes:
        if dtype.is_floating_point:
            widest = dtype if widest is None else exact_common_dtype(widest, dtype)
    return widest or torch.float32


def config_dtype_for(tensors: Iterable[PlannedTensor], options: MergeOptions) -> torch.dtype:
    """What config.json will say for these tensors under ``--dtype`` (``inspect``, before any plan of the output)."""
    requested = DTYPES.get(options.dtype)
    return auto_config_dtype(_output_dtype(t, requested) for t in tensors)


@dataclass(frozen=True)
class KeptFromPass:
    """A tensor written right after the quantized weight whose pass computes it (its scales, zero points):
    ``take`` hands over what that pass kept, freeing it (``None`` before the pass ran); the writer's order
    runs the pass first, otherwise the weight is read and quantized again to get it."""

    weight: TensorSource  # the quantized weight's: its ``pieces()`` run the pass
    take: Callable[[], torch.Tensor | None]

    def byte_runs(self) -> None:
        return None

    def pieces(self) -> Iterator[torch.Tensor]:
        kept = self.take()
        if kept is None:
            for _ in self.weight.pieces():
                pass
            kept = self.take()
        yield kept


def quantized_shards(
    model: list[OutputTensor],
    quantized: Quantized,
    kept_dtype: torch.dtype,
    max_shard_size: str | int,
) -> list[ShardFile]:
    """The shards of ``model`` with each weight ``quantized`` takes (it returns the leading output and the
    followers written right after it, else None) quantized; every other floating tensor in ``kept_dtype``."""
    tensors: list[OutputTensor] = []
    followers: dict[str, tuple[OutputTensor, ...]] = {}
    for t in model:
        outputs = quantized(t.planned)
        if outputs is None:
            tensors.append(OutputTensor(t.planned, kept_dtype if t.dtype.is_floating_point else t.dtype))
        else:
            tensors.append(outputs[0])
            followers[outputs[0].planned.name] = outputs[1]
    return _split_shards(tensors, max_shard_size, followers=followers)


def _split_shards(
    tensors: list[OutputTensor],
    max_shard_size: str | int,
    *,
    followers: dict[str, tuple[OutputTensor, ...]] | None = None,
) -> list[ShardFile]:
    """HF-style shards of ``tensors``; the ``followers`` of a tensor (by its name) are written right after
    it, in the same shard (a quantized weight's scales: computed while the weight is written)."""
    followers = followers or {}
    split = split_state_dict_into_shards_factory(
        {t.planned.name: t for t in tensors},
        get_storage_size=lambda t: t.nbytes + sum(f.nbytes for f in followers.get(t.planned.name, ())),
        filename_pattern=WEIGHTS_PATTERN,
        max_shard_size=parse_size(max_shard_size, "--max-shard-size"),  # ours: HF's takes "1e999GB" to a crash
    )
    by_name = {t.planned.name: t for t in tensors}
    return [
        ShardFile(
            filename,
            tuple(t for n in names for t in (by_name[n], *followers.get(n, ()))),
        )
        for filename, names in split.filename_to_tensors.items()
    ]
