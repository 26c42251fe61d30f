"""The Dagster code location: one small module per kind of definition, merged in ``definitions.py``.

Everything here is a thin layer over ``merge_pipeline.engine``; the engine never imports dagster.
"""
