"""Per-run merge options, set in the Launchpad (or a sensor's run config) for ``hf_model``."""

from __future__ import annotations

from typing import Literal

import dagster as dg
from pydantic import Field

from merge_pipeline.options import DEFAULT_MAX_SIDE_FILE_SIZE, DTYPE_CHOICES, MergeOptions


class MergeConfig(dg.Config):
    dtype: Literal[DTYPE_CHOICES] = Field(
        default="auto",
        description="output dtype; auto keeps what the checkpoint stores (never loses precision unasked)",
    )
    max_shard_size: str = Field(default="5GB", description="largest safetensors shard, HF style (e.g. 5GB, 500MB)")
    merge_lora: bool = Field(
        default=False, description="fold LoRA into the base weights instead of writing lora_adapter/"
    )
    max_side_file_size: str = Field(
        default=DEFAULT_MAX_SIDE_FILE_SIZE,
        description="largest file copied from the checkpoint's huggingface/ folder (tokenizer, templates, ...), HF style",
    )
    overwrite: bool = Field(
        default=False, description="replace an existing merged folder, once the new one is complete"
    )
    hf_model_path: str | None = Field(
        default=None,
        description="the original HF model folder (the trainer's model.path): config, tokenizer and LoRA base weights when the checkpoint holds none",
    )
    launcher: Literal["inprocess", "torchrun"] = Field(
        default="inprocess",
        description="write the shards in the run's process, or across processes (and nodes) with torchrun",
    )
    nproc_per_node: int = Field(default=2, ge=1, description="torchrun: processes on this node")
    nnodes: int = Field(
        default=1,
        ge=1,
        description="torchrun: nodes; the others run the same command with their --node-rank (see README)",
    )
    rdzv_endpoint: str = Field(default="127.0.0.1:29400", description="torchrun: rendezvous host:port when nnodes > 1")

    def options(self) -> MergeOptions:
        return MergeOptions(
            dtype=self.dtype,
            max_shard_size=self.max_shard_size,
            merge_lora=self.merge_lora,
            overwrite=self.overwrite,
            hf_model_path=self.hf_model_path,
            max_side_file_size=self.max_side_file_size,
        )
