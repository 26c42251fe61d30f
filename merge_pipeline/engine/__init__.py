"""Backend-agnostic merge engine: plan -> streaming safetensors writer -> HF folder -> atomic publish.

Never imports dagster: the orchestration layer calls in, never the other way.
"""
