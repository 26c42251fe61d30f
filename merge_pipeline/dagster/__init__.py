"""The Dagster side: the ``MergeCheckpoints`` component (``component.py``) and one small module per kind of
definition it builds, plus what this package adds to a Dagster instance (``instance.yaml``, the run launcher).

Everything here is a thin layer over ``merge_pipeline.pipeline`` (never a reader or the writer directly:
of ``formats`` it asks only the registry's step-folder questions); every module here imports dagster. What
runs without it (watching the checkpoint roots, the settings, the webserver client) lives in
``merge_pipeline.watch`` and ``merge_pipeline.webserver``.
"""
