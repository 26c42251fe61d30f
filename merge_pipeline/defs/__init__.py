"""This project's own definitions folder (``[tool.dg.project] defs_module``); the component they
instantiate lives in ``merge_pipeline.dagster``."""
