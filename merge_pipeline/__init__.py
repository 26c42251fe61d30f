"""Merge sharded training checkpoints (FSDP, Megatron-Core) into Hugging Face model folders."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `merge_pipeline.MergeCheckpoints`, the Dagster component's type name in a defs.yaml, imported
    # only when asked for: `import merge_pipeline` (the CLI) stays free of dagster.
    if name == "MergeCheckpoints":
        from merge_pipeline.dagster.component import MergeCheckpoints

        return MergeCheckpoints
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return [*globals(), "MergeCheckpoints"]  # dg's registry lists a module's objects with dir()
