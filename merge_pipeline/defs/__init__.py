"""The Dagster code location: one small module per kind of definition, merged in ``definitions.py``.

Everything here is a thin layer over ``merge_pipeline.pipeline`` (never the readers or the writer
directly); nothing below it imports dagster.
"""
