"""Does the merged folder run? Loaded with transformers on CPU: a few greedy tokens for a prompt (a
person reads them), and the mean next-token loss on a short fixed text (a number steps compare).

Bounded by the caller (the folder's weight bytes against a limit): the model is loaded whole.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

# Short, plain and fixed: the same text for every step, so the losses of a run's steps compare.
FIXED_TEXT = (
    "The trainer saves a checkpoint every few steps. Each rank writes its own shard of the model weights. "
    "A merge joins the shards into one Hugging Face folder."
)
NEW_TOKENS = 8
DEFAULT_PROMPT = "The trainer saves a checkpoint"


@dataclass(frozen=True)
class SmokeResult:
    prompt: str
    text: str  # the greedy continuation only, special tokens left out
    loss: float  # mean next-token cross-entropy on FIXED_TEXT
    seconds: float


def generates_text(folder: Path) -> str | None:
    """None when the folder is a language model that can generate, else why not (one line)."""
    architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    if not any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures):
        return f"{', '.join(architectures) or 'no architecture'} does not generate text (a value model?)"
    return None


def smoke_test(folder: Path, prompt: str, *, trust_remote_code: bool = False) -> SmokeResult:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    # use_kernels=False: no kernel download from the Hub (transformers 5.25's default): plain CPU layers
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype="auto", trust_remote_code=trust_remote_code, use_kernels=False
    )
    model.eval()
    with torch.inference_mode():
        asked = tokenizer(prompt, return_tensors="pt")
        generated = model.generate(
            **asked,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        fixed = tokenizer(FIXED_TEXT, return_tensors="pt")
        loss = model(**fixed, labels=fixed["input_ids"]).loss.float().item()
    text = tokenizer.decode(generated[0, asked["input_ids"].shape[1] :], skip_special_tokens=True)
    return SmokeResult(prompt, text, loss, time.monotonic() - started)
