"""The checkpoint's ``huggingface/config.json``: what it says about tying and heads, and its rewrite."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from merge_pipeline.errors import MergeError
from merge_pipeline.input_files import contained_file
from merge_pipeline.json_files import read_json_object

CONFIG = "config.json"


@dataclass
class ModelConfig:
    path: Path  # the config.json read
    raw: dict  # exactly what the file says; rewritten for the output
    trust_remote_code: bool = False

    @cached_property
    def tie_word_embeddings(self) -> bool:
        for section in (self.raw, self.raw.get("text_config") or {}):
            if "tie_word_embeddings" in section:
                return bool(section["tie_word_embeddings"])
        # Not stated: the model type's own default. Only then pay for importing transformers (~1 s).
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(self.path.parent, trust_remote_code=self.trust_remote_code)
        except ValueError as exc:
            hint = "" if self.trust_remote_code else " (pass --trust-remote-code for a remote-code model)"
            raise MergeError(self.path, f"transformers cannot read it: {str(exc).splitlines()[0]}{hint}") from None
        return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))

    @property
    def lm_head_name(self) -> str:
        return "lm_head.weight"

    @property
    def architecture(self) -> str | None:
        archs = self.raw.get("architectures") or []
        return archs[0] if archs else None


def load_model_config(hf_dir: Path | None, *, trust_remote_code: bool, role_dir: Path) -> ModelConfig:
    path = (hf_dir or role_dir / "huggingface") / CONFIG
    if not path.is_file():
        raise MergeError(path, "not found: the checkpoint needs huggingface/config.json to build an HF model folder")
    contained_file(path, role_dir)  # it is copied (rewritten) into the output, and transformers reads it
    raw = read_json_object(path)
    if "model_type" not in raw:
        raise MergeError(path, "not a transformers config (no 'model_type')")
    return ModelConfig(path, raw, trust_remote_code)


def output_config(model: ModelConfig, *, dtype: torch.dtype, tied: bool, value_model: bool) -> dict:
    """config.json for the merged folder: the source's, with dtype, tying and value head made true."""
    out = dict(model.raw)
    dtype_name = str(dtype).removeprefix("torch.")
    out["dtype"] = dtype_name
    if "torch_dtype" in out:  # older transformers spell it so; keep both in agreement
        out["torch_dtype"] = dtype_name
    if tied and not model.tie_word_embeddings:
        out["tie_word_embeddings"] = True
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
    raise MergeError(model.path, f"value model: no transformers *ForTokenClassification class for architecture {arch or '(none)'}")
