"""The checkpoint's ``huggingface/config.json``: what it says about tying and heads, and its rewrite."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.files.json_files import read_json_object
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import dtype_name

CONFIG = "config.json"
LM_HEAD = "lm_head.weight"
VALUE_HEAD = "score.weight"  # a value model's (critic, reward) head: *ForTokenClassification with one label


def model_section(raw: dict) -> dict:
    """The config of the model a trainer trains: an Omni model's thinker (``thinker_config``; its talker, which
    speaks, is not built by Megatron-Bridge), else the config itself."""
    return raw.get("thinker_config") or raw


def text_section(raw: dict) -> dict:
    """The language model's config: ``text_config`` of a multimodal model (an Omni model's thinker's), else the
    model's own."""
    section = model_section(raw)
    return section.get("text_config") or section


def has_value_head(names: Iterable[str]) -> bool:
    """Weights of a value model: a score head and no LM head (names may carry a prefix, PEFT's for one)."""
    names = list(names)
    return any(n.endswith(VALUE_HEAD) for n in names) and not any(n.endswith(LM_HEAD) for n in names)


@dataclass
class ModelConfig:
    path: Path  # the config.json read
    raw: dict  # exactly what the file says; rewritten for the output
    trust_remote_code: bool = False
    # Files beside it must resolve inside this folder (the checkpoint's); None for the original
    # model folder the user named with --hf_model_path (a Hub cache snapshot links into ../blobs).
    confine_to: Path | None = None

    @cached_property
    def tie_word_embeddings(self) -> bool:
        for section in (self.raw, model_section(self.raw), text_section(self.raw)):
            if "tie_word_embeddings" in section:
                return bool(section["tie_word_embeddings"])
        # Not stated: the model type's own default. Only then pay for importing transformers (~1 s).
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.path.parent, trust_remote_code=self.trust_remote_code)
        except ValueError as exc:
            hint = "" if self.trust_remote_code else " (pass --trust-remote-code for a remote-code model)"
            raise MergeError(self.path, f"transformers cannot read it: {first_line(exc)}{hint}") from None
        return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))

    @property
    def lm_head_name(self) -> str:
        return LM_HEAD

    @property
    def architecture(self) -> str | None:
        archs = self.raw.get("architectures") or []
        return archs[0] if archs else None


def load_model_config(
    hf_dir: Path | None, *, trust_remote_code: bool, role_dir: Path, hf_model_path: str | Path | None = None
) -> ModelConfig:
    """The checkpoint's own config.json; the original model's (``hf_model_path``) when it has none.

    When both exist the checkpoint's wins, and they must describe the same model: a different
    architecture or size means the wrong original folder was given.
    """
    hf_dir = hf_dir or role_dir / "huggingface"
    path = hf_dir / CONFIG
    original = Path(hf_model_path) / CONFIG if hf_model_path else None
    if original is not None and not original.is_file():
        raise MergeError(
            original, "not found: --hf_model_path must be the original Hugging Face model folder, with its config.json"
        )
    if not path.is_file():
        if original is not None:
            return _read_config(original, trust_remote_code)
        if hf_dir.is_dir() and any(hf_dir.iterdir()):  # verl creates huggingface/ empty when it saves none
            raise MergeError(
                path,
                f"not found: the checkpoint needs {hf_dir.name}/config.json to build an HF model folder, or --hf_model_path with the original model folder",
            )
        # verl writes no HF files at all when it saves Megatron shards without 'hf_model'.
        raise MergeError(
            path,
            "not found: the checkpoint holds no Hugging Face config; pass --hf_model_path with the original model folder (the trainer's model.path)",
        )
    # It is copied (rewritten) into the output: read once, from inside the checkpoint only.
    config = _read_config(path, trust_remote_code, confine_to=role_dir)
    if original is not None:
        _check_same_model(config, _read_config(original, trust_remote_code))
    return config


@dataclass
class CheckpointConfig:
    """One checkpoint's model config, read once on first ask (``load_model_config`` with the user's
    options): the readers that need it to plan (Megatron's shards, torchtitan) and the merge after
    them get the same one, and a checkpoint planned without it (FSDP) never reads it."""

    role_dir: Path
    trust_remote_code: bool = False
    hf_model_path: str | Path | None = None
    _loaded: dict[Path | None, ModelConfig] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, role_dir: Path, options: MergeOptions) -> CheckpointConfig:
        return cls(Path(role_dir).absolute(), options.trust_remote_code, options.hf_model_path)

    def load(self, hf_dir: Path | None) -> ModelConfig:
        """The config in the checkpoint's ``hf_dir`` (``None``: its ``huggingface/``), else ``--hf_model_path``'s."""
        if hf_dir not in self._loaded:
            self._loaded[hf_dir] = load_model_config(
                hf_dir,
                trust_remote_code=self.trust_remote_code,
                role_dir=self.role_dir,
                hf_model_path=self.hf_model_path,
            )
        return self._loaded[hf_dir]


def _read_config(path: Path, trust_remote_code: bool, *, confine_to: Path | None = None) -> ModelConfig:
    raw = read_json_object(path, inside=confine_to)
    if "model_type" not in raw:
        raise MergeError(path, "not a transformers config (no 'model_type')")
    return ModelConfig(path, raw, trust_remote_code, confine_to)


# What must agree between the checkpoint's config and the original model's: the architecture and
# every size that shapes a tensor. (dtype, token ids, rope scaling may legitimately differ.)
_SAME_MODEL_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "q_lora_rank",
    "kv_lora_rank",
    "tie_word_embeddings",
)


def _check_same_model(checkpoint: ModelConfig, original: ModelConfig) -> None:
    differences = []
    for section in (None, "text_config"):
        ours = checkpoint.raw.get(section) if section else checkpoint.raw
        theirs = original.raw.get(section) if section else original.raw
        if not isinstance(ours, dict) or not isinstance(theirs, dict):
            continue
        for key in _SAME_MODEL_KEYS:
            if key in ours and key in theirs and ours[key] != theirs[key]:
                differences.append(f"{section + '.' if section else ''}{key} {ours[key]!r} vs {theirs[key]!r}")
    if differences:
        raise MergeError(
            original.path,
            f"--hf_model_path describes another model than the checkpoint's {checkpoint.path}: {'; '.join(differences)}",
        )


def output_config(model: ModelConfig, *, dtype: torch.dtype, tied: bool, value_model: bool) -> dict:
    """config.json for the merged folder: the source's, with dtype, tying and value head made true."""
    out = dict(model.raw)
    out["dtype"] = dtype_name(dtype)
    if "torch_dtype" in out:  # older transformers spell it so; keep both in agreement
        out["torch_dtype"] = dtype_name(dtype)
    if tied and not model.tie_word_embeddings:
        out["tie_word_embeddings"] = True
    if not tied and not value_model and model.tie_word_embeddings:  # --untie-word-embedding: lm_head is kept
        out["tie_word_embeddings"] = False
        if "tie_word_embeddings" in (out.get("text_config") or {}):
            out["text_config"] = {**out["text_config"], "tie_word_embeddings": False}
    if value_model:
        out["architectures"] = [_token_classification(model)]
        out["num_labels"] = 1
        out["id2label"] = {"0": "LABEL_0"}
        out["label2id"] = {"LABEL_0": 0}
    return out


def _token_classification(model: ModelConfig) -> str:
    arch = model.architecture or ""
    stem = arch.removesuffix("ForCausalLM") if arch.endswith("ForCausalLM") else None
    import transformers

    if stem and hasattr(transformers, f"{stem}ForTokenClassification"):
        return f"{stem}ForTokenClassification"
    raise MergeError(
        model.path, f"value model: no transformers *ForTokenClassification class for architecture {arch or '(none)'}"
    )
