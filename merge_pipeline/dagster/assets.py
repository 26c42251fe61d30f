"""The merge as assets: the trainer's ``checkpoint`` folder (external), then ``parallel_config`` -> ``state_dict``
-> ``hf_model``, the three stages of one step (``merge_step``) describing parts of the published folder.

All are partitioned by checkpoint (``<run_name>/global_step_<N>/<role>`` for verl; see ``partitions``); everything
the step needs is derived from the partition key and the ``settings`` resource, so nothing passes
between assets but the dependency. The stages are one step that cannot be subset, because they share the merge plan and the target's
lock: plan once, write the whole folder into the staging folder beside the target, run the blocking
checks against that staging folder, and publish (rename into place) only if every check passed. A
failure at any stage leaves no staging folder and no published folder, and materializes nothing. The
checks are asset checks of ``hf_model`` (``checks``): their results come with its materialization.
"""

import dataclasses
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta

import dagster as dg

from merge_pipeline.dagster.checks import blocking_check_specs, check_results, passed_metadata
from merge_pipeline.dagster.failures import one_line_failure
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.pins import unpin
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.dagster.run_config import MergeConfig, merge_config_class, overridden
from merge_pipeline.dagster.stages import hf_model_metadata, parallel_config_metadata, state_dict_metadata
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.blocking_checks import BlockingChecksFailed
from merge_pipeline.watch.keys import GROUP, MERGE_POOL, OWNERS
from merge_pipeline.watch.location_settings import HF_MODEL_PATH, SETTLE_SECONDS
from merge_pipeline.watch.partitions import checkpoint_key


def checkpoint_spec(names: Names) -> dg.AssetSpec:
    """The trainer writes checkpoints, not Dagster: an external asset. new_checkpoint_sensor records each
    complete one (a materialization event with its path and completeness) when it requests its merge."""
    return dg.AssetSpec(
        names.key("checkpoint"),
        partitions_def=names.partitions,
        group_name=names(GROUP),
        owners=OWNERS,
        kinds={"pytorch"},
        tags={"stage": "source"},
        description="A trainer's checkpoint folder, written by the trainer.\n\nUnder a watched root (a step folder some format reader declares; each event names its stack); recorded by new_checkpoint_sensor once complete.",
    )


def freshness_policy(minutes: float) -> dg.FreshnessPolicy:
    """Stale when no step was published for N minutes ($MERGE_PIPELINE_FRESHNESS_MINUTES, default 30):
    a trainer saving more often than that sees a stuck or failing merge flagged in the UI."""
    return dg.FreshnessPolicy.time_window(fail_window=timedelta(minutes=minutes))


def stage_specs(names: Names, freshness_minutes: float) -> list[dg.AssetSpec]:
    """The three stages of one step. Each describes a part of the published folder; none holds data of
    its own that a later failure could leave behind."""

    def stage(name: str, upstream: str, kinds: set[str], stage: str, description: str, **more) -> dg.AssetSpec:
        return dg.AssetSpec(
            names.key(name),
            deps=[names.key(upstream)],
            partitions_def=names.partitions,
            group_name=names(GROUP),
            owners=OWNERS,
            kinds=kinds,
            tags={"stage": stage},
            description=description,
            **more,
        )

    return [
        stage(
            "parallel_config",
            "checkpoint",
            {"pytorch"},
            "plan",
            "What the checkpoint is and what the merge plan decided.\n\nThe checkpoint: backend, world size, mesh / TP / PP / EP, stored dtypes, tensors, parameters, bytes (the same facts as `merge-pipeline inspect`). The plan: output dtype, shards, tying, LoRA handling.",
        ),
        stage(
            "state_dict",
            "parallel_config",
            {"safetensors"},
            "weights",
            "The published folder's weights: safetensors files, index.\n\nThe reconstructed weights in the published folder: the safetensors files and index, their sha256 and sizes, the write's throughput.",
        ),
        stage(
            "hf_model",
            "state_dict",
            {"safetensors", "huggingface"},
            "published",
            "The complete Hugging Face folder, checked, then published.\n\nWeights, index, config, tokenizer and manifest, checked in a staging folder, then renamed into place at once.",
            freshness_policy=freshness_policy(freshness_minutes),
        ),
    ]


def merge_step_definition(
    names: Names, freshness_minutes: float, merge_config: dict | None = None
) -> dg.AssetsDefinition:
    """``merge_config``: the component's (checked), the defaults of the step's config."""
    config_class = merge_config_class(merge_config or {})

    @dg.multi_asset(
        name=names("hf_model"),  # the op's name: run configs say ops: hf_model: config: ...
        specs=stage_specs(names, freshness_minutes),
        check_specs=blocking_check_specs(names),
        partitions_def=names.partitions,
        can_subset=False,  # the plan is built once and the three stages are published together, or not at all
        pool=MERGE_POOL,
        required_resource_keys={names("settings")},
    )
    def merge_step(context: dg.AssetExecutionContext, config: config_class) -> Iterator:
        """Plan, write, check and publish one checkpoint; then materialize its three stages.

        Plans the merge once, writes the folder into a staging folder beside the target under the
        target's lock, runs the three blocking checks against the staging folder, and renames it into
        place only if all passed.
        """
        settings: MergeSettings = getattr(context.resources, names("settings"))
        if merge_config and (differing := overridden(config)):
            context.log.info("this run's config overrides the component's merge_config: %s", ", ".join(differing))
        try:
            yield from _merge(context, config, settings, names)
        finally:  # published or failed: the pin (pin_steps) has done its job
            _remove_pin(settings, context.partition_key)

    with warnings.catch_warnings():  # source code references are a beta feature in Dagster 1.13
        warnings.simplefilter("ignore", dg.BetaWarning)
        # The UI's "Code" tab shows where each asset is defined.
        [with_code] = dg.with_source_code_references([merge_step])
    return with_code


def _remove_pin(settings: MergeSettings, partition_key: str) -> None:
    try:
        key = checkpoint_key(partition_key)
    except MergeError:  # no checkpoint's key: the step failed on it, and nothing was pinned for it
        return
    for space in settings.pin_spaces:  # unpin removes only a folder of ours, never through a link
        unpin(space, key)


def _merge(context: dg.AssetExecutionContext, config: MergeConfig, settings: MergeSettings, names: Names) -> Iterator:
    # Imported here, by the run: they import torch and transformers, which the code location's load
    # (the UI's, and each run worker's before it reports the run started) does not need.
    from merge_pipeline.dagster.weights import step_workers
    from merge_pipeline.pipeline.merge import merge
    from merge_pipeline.watch.discovery import Completeness, completeness, newest_change

    key = checkpoint_key(context.partition_key)
    target = settings.target_dir(key)
    with one_line_failure():
        options = config.options()  # tie and untie together are refused in one line, as by the CLI
        if options.hf_model_path is None and settings.value(HF_MODEL_PATH):  # the sensor's runs carry no run config
            options = dataclasses.replace(options, hf_model_path=settings.value(HF_MODEL_PATH))
        pinned = settings.pinned(key)  # the sensor's hard links (pin_steps): the trainer may have deleted the step
        role_dir = pinned[1] if pinned else settings.role_dir(key)
        state = (
            Completeness(True, "pinned by the sensor when complete", newest_change(role_dir))
            if pinned
            else completeness(
                role_dir, key.step, settings.value(SETTLE_SECONDS)
            )  # a run started by hand may come too early
        )
        if not state.complete:
            raise MergeError(role_dir, f"incomplete checkpoint: {state.reason}")
        # The CLI's sequence: under the target's lock (a merge running there makes this step fail), resuming
        # what a killed run of this step finished (the instance retries a run whose worker died), the
        # blocking checks before the rename; a failure publishes nothing.
        try:
            with step_workers(context, config) as workers:
                merged = merge(role_dir, target, options, workers=workers)
        except BlockingChecksFailed as refused:  # each check's outcome on the partition, then the CLI's line
            yield from check_results(refused.outcomes, target, names)
            raise
        plan_facts = parallel_config_metadata(merged.prepared, options, merged.manifest)
        checked = check_results(merged.checks, target, names)
    written = merged.written
    # After publishing: each stage describes its part of the published folder.
    yield dg.MaterializeResult(asset_key=names.key("parallel_config"), metadata=plan_facts)
    yield dg.MaterializeResult(
        asset_key=names.key("state_dict"),
        metadata={
            **state_dict_metadata(
                target, written.report, merged.manifest, (written.peak_rss_label, written.peak_rss_bytes)
            ),
            "launcher": config.launcher_label(),
        },
    )
    yield dg.MaterializeResult(
        asset_key=names.key("hf_model"),
        metadata={
            **hf_model_metadata(target, merged.prepared, merged.manifest),
            "source": dg.MetadataValue.path(str(role_dir)),
            "completeness": state.reason,
            "seconds since the checkpoint was written": round(time.time() - state.newest_change, 1),
            "seconds": round(merged.seconds, 3),
            **passed_metadata(merged.checks),
        },
    )
    # Computed before publishing, recorded right after the materialization, so each result names it as the
    # folder it checked (Dagster looks up the partition's latest materialization for each check result).
    yield from checked
