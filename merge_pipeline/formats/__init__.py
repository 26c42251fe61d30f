"""Format readers: each turns a role folder into a ``CheckpointPlan`` without loading tensor data."""

from __future__ import annotations

from pathlib import Path

from merge_pipeline.engine.plan import CheckpointPlan
from merge_pipeline.errors import MergeError

BACKENDS = ("auto", "fsdp", "megatron", "hf", "deepspeed")
NEMO_MODEL_DIR = "model"  # NeMo-Automodel: consolidated HF safetensors + config in <role>/model/


def detect_backend(role_dir: Path) -> str:
    from merge_pipeline.formats.fsdp import is_fsdp_dir
    from merge_pipeline.formats.megatron import is_megatron_dir

    if is_fsdp_dir(role_dir):
        return "fsdp"
    if is_megatron_dir(role_dir):
        return "megatron"
    from merge_pipeline.formats.deepspeed import is_deepspeed_dir

    if is_deepspeed_dir(role_dir):
        return "deepspeed"
    if (role_dir / NEMO_MODEL_DIR / "config.json").is_file() and any((role_dir / NEMO_MODEL_DIR).glob("*.safetensors")):
        return "hf"
    raise MergeError(
        role_dir,
        "neither an FSDP checkpoint (model_world_size_*_rank_*.pt) nor a Megatron one (ckpt_contents.json, model/dist_ckpt/, model/huggingface/, or legacy dist_ckpt/) nor consolidated HF weights (model/*.safetensors) nor DeepSpeed ZeRO (latest, *_optim_states.pt)",
    )


def open_checkpoint(
    role_dir: str | Path,
    backend: str = "auto",
    *,
    verify_replicas: bool = False,
    is_value_model: bool = False,
    tie_word_embedding: bool = False,
    trust_remote_code: bool = False,
    hf_model_path: str | None = None,
) -> CheckpointPlan:
    """Discover and validate one role folder (``global_step_N/actor``); every problem is a ``MergeError``.

    ``hf_model_path``: the original HF model folder, for a config (and LoRA base weights) the
    checkpoint does not hold.
    """
    role_dir = Path(role_dir).absolute()
    if not role_dir.is_dir():
        raise MergeError(role_dir, "not a directory" if role_dir.exists() else "does not exist")
    if backend not in BACKENDS:
        raise MergeError(None, f"--backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend == "auto":
        backend = detect_backend(role_dir)
    if backend == "fsdp":
        from merge_pipeline.formats.fsdp import plan_fsdp

        return plan_fsdp(role_dir, verify_replicas=verify_replicas)
    if backend == "deepspeed":
        from merge_pipeline.formats.deepspeed import plan_deepspeed

        return plan_deepspeed(role_dir)
    if backend == "hf":
        from merge_pipeline.formats.hf import plan_hf_safetensors

        return plan_hf_safetensors(
            role_dir, role_dir / NEMO_MODEL_DIR, is_value_model=is_value_model or None, backend="hf"
        )
    from merge_pipeline.formats.megatron import plan_megatron

    return plan_megatron(
        role_dir,
        is_value_model=is_value_model or None,
        tie_word_embedding=tie_word_embedding or None,
        trust_remote_code=trust_remote_code,
        hf_model_path=hf_model_path,
    )
