"""Merge sharded training checkpoints (FSDP, Megatron-Core) into Hugging Face model folders."""

__version__ = "0.1.0"
