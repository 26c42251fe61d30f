"""``promoted_model``: make one merged step what a serving stack pulls, launched for its partition.

Materializing it for a partition (job ``promote_step``, from the UI's partition picker) promotes that step:
- on the Hub (with ``hub: organization:``): ``main`` of the step's repo made to hold the files of the commit
  ``hub_model`` published and verified for it, copied server-side (``hub.promotion``: no weight byte sent);
- in a store (an ``output_root`` of ``s3://...``): the step's prefix copied server-side to
  ``<output_root>/promoted/<run>/<role>``, manifest last (``store.published_prefix.copy_published_in_store``).
What was promoted where is this asset's metadata for the step's partition; the latest materialization of a
run's partitions names the step served. With ``promote_best_by`` set, ``promotion_sensor`` launches the job
for each run's best evaluated step.
"""

import dagster as dg

from merge_pipeline.checkpoint_name import STEP_ROLE, CheckpointName
from merge_pipeline.dagster.failures import one_line_failure
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.dagster.records import latest_materialization
from merge_pipeline.dagster.resources import MergeSettings
from merge_pipeline.errors import MergeError
from merge_pipeline.settings import HUB_TIMEOUT
from merge_pipeline.store.listing import StoreURL, in_store
from merge_pipeline.watch.keys import HUB_GROUP
from merge_pipeline.watch.location_settings import HUB_ENDPOINT, HUB_TOKEN, OUTPUT_ROOT
from merge_pipeline.watch.partitions import checkpoint_key

PROMOTED = "promoted"  # the prefix under output_root a server pulls from


def promoted_url(settings: MergeSettings, key: CheckpointName) -> StoreURL:
    """``<output_root>/promoted/<run>/<role>``: one place per run and role, whichever step it holds."""
    parts = [PROMOTED, *([key.run] if key.run else []), *([key.role] if key.role != STEP_ROLE else [])]
    return settings.value(OUTPUT_ROOT) / "/".join(parts)


def promotion_definitions(names: Names) -> "tuple[dg.AssetsDefinition, dg.UnresolvedAssetJobDefinition]":
    @dg.asset(
        key=names.key("promoted_model"),
        partitions_def=names.partitions,
        group_name=names(HUB_GROUP),
        deps=[names.key("hf_model"), names.key("hub_model")],
        kinds={"huggingface"},
        required_resource_keys={names("settings"), names("hub")},
    )
    def promoted_model(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        """The served step: Hub main, promoted/ in its store.

        Materialize it for one partition to promote that step (server-side copies, nothing uploaded again)."""
        settings: MergeSettings = getattr(context.resources, names("settings"))
        hub = getattr(context.resources, names("hub"))  # dagster.hub_model's HuggingFaceHub
        with one_line_failure():
            return dg.MaterializeResult(metadata=_promote(context, settings, hub, names))

    job = dg.define_asset_job(
        names("promote_step"),
        selection=dg.AssetSelection.assets(names.key("promoted_model")),
        description="Promote one merged step to what a server pulls.\n\nmain of its Hub repo, promoted/ in its store: server-side copies.",
    )
    return promoted_model, job


def _promote(context: dg.AssetExecutionContext, settings: MergeSettings, hub, names: Names) -> dict:
    from merge_pipeline.hub.promotion import promote_to_main  # huggingface_hub: by the run, not the location's load
    from merge_pipeline.store.lock import locked_store_target
    from merge_pipeline.store.published_prefix import copy_published_in_store, unguarded
    from merge_pipeline.store.target_rules import check_store_target

    key = checkpoint_key(context.partition_key)
    target = settings.target_dir(key)
    metadata: dict = {"step": str(key)}
    if in_store(target):
        copied_to = promoted_url(settings, key)
        # a merge's target rules: objects we did not write there are refused, one writer at a time
        check_store_target(copied_to, overwrite=True)
        with locked_store_target(copied_to) as lock:
            manifest = copy_published_in_store(target, copied_to, guard=lock.guard if lock else unguarded)
        metadata |= {"promoted prefix": copied_to, "files copied": len(manifest["files"]) + 1}
    if hub.enabled:
        published = latest_materialization(context.instance, names.key("hub_model"), context.partition_key)
        if published is None:
            raise MergeError(None, f"{key}: not on the Hub yet: materialize hub_model for this partition first")
        recorded = published.asset_materialization.metadata
        promoted = promote_to_main(
            recorded["repo"].value,
            recorded["commit_url"].value.rsplit("/", 1)[-1],  # the commit hub_model verified, not its branch's head now
            endpoint=hub.value(HUB_ENDPOINT),
            token=hub.value(HUB_TOKEN),
            timeout_s=hub.value(HUB_TIMEOUT),
        )
        metadata |= {
            "repo": promoted.repo_id,
            "promoted commit": promoted.source,
            "main": dg.MetadataValue.url(promoted.commit_url),
            "files": promoted.files,
            "deleted from main": ", ".join(promoted.deleted) or "nothing",
        }
    if len(metadata) == 1:
        raise MergeError(None, f"{key}: nowhere to promote it: no Hub organization, and output_root is a local folder")
    return metadata
