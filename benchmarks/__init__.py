"""Benchmarks: merge real FSDP checkpoints with merge_pipeline (and optionally verl), side by side.

Run ``python -m benchmarks.run --help`` from the repository root; see docs/BENCHMARKS.md.
"""
