"""``inspect``: what a checkpoint holds, from metadata only."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from merge_pipeline.engine.hf_config import load_model_config
from merge_pipeline.engine.lora import has_lora_tensors
from merge_pipeline.errors import MergeError
from merge_pipeline.formats import open_checkpoint


def describe(
    local_dir: Path, *, backend: str = "auto", trust_remote_code: bool = False, hf_model_path: str | None = None
) -> dict:
    with open_checkpoint(local_dir, backend, trust_remote_code=trust_remote_code, hf_model_path=hf_model_path) as plan:
        dtypes = Counter()
        for t in plan.tensors:
            dtypes[str(t.dtype).removeprefix("torch.")] += t.numel
        try:
            config = load_model_config(
                plan.hf_dir, trust_remote_code=trust_remote_code, role_dir=plan.role_dir, hf_model_path=hf_model_path
            )
            architecture, tied = config.architecture, config.tie_word_embeddings
        except MergeError as exc:
            architecture, tied = f"unknown ({exc.problem})", None
        return {
            "backend": plan.backend,
            "role": plan.role,
            "path": str(plan.role_dir),
            **plan.layout,
            "architecture": architecture,
            "parameters": plan.parameter_count,
            "tensors": len(plan.tensors),
            "dtypes": dict(dtypes),
            "bytes": sum(t.nbytes() for t in plan.tensors),
            "lora": has_lora_tensors(plan.tensors),
            "value_model": plan.is_value_model,
            "tied_word_embeddings": tied,
            "files": [{"path": str(f.path), "size": f.size} for f in plan.files],
        }
