"""The names the merge step, the step report, the Hub and the averaged model share: asset groups,
owners, the pool and run tag that keep heavy runs apart, and the metadata keys one writes and another
reads, and the pin folder's name. One home, below all of them, so none imports another just for a string."""

GROUP = "merge"  # the merge's assets (an instance's: <prefix>__merge)
HUB_GROUP = "hub"
HUB_CRON = "*/10 * * * *"  # publish_latest_steps, unless the component's hub: schedule says otherwise
OWNERS = ["team:training-infra"]
MERGE_POOL = "merge"  # dagster.yaml gives every pool one slot: one heavy merge at a time
HEAVY_TAG = "merge_pipeline/heavy"  # dagster.yaml lets one run with this tag run at a time
AUTOMATED_BY = "merge_pipeline/automated_by"  # the automation sensor that requested a run (its runs share one job name)

# the blocking checks: on hf_model (its asset checks hold each result) and averaged_model, that all passed
CHECKED = "checked before publishing"  # averaged_model (no asset checks): a table of the checks that looked at it
PASSED = "blocking checks passed"  # on hf_model: every check, so its materialization says the whole folder passed

# step_report, read by the Hub (the model card, and whether a step may be published)
NAN, INF = "NaN", "Inf"
SMOKE, SMOKE_PROMPT, SMOKE_TEXT, SMOKE_LOSS = "smoke test", "smoke prompt", "smoke text", "smoke loss (fixed text)"

# the folder in a checkpoint root where pin_steps hard-links steps, unless pin_root says elsewhere
PINS = ".merge_pins"
# evaluation, read by the Hub where a threshold is set (a step is published only when its evaluation met it)
THRESHOLD_MET = "threshold met"
