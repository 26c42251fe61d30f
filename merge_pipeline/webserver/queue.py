"""``merge-pipeline queue KEY``: a merge of one step put in the run queue of a running Dagster webserver.

``dg launch`` runs the merge in its own process, outside the queue, and like ``dagster job launch`` it
answers a wrong instance (no ``DAGSTER_HOME``, another instance's partition) with a traceback. This
asks the webserver the user opened (the UI's own GraphQL API, through ``client``: one deadline,
a bounded answer, no password shown), so the run lands in the instance the sensor fills, waits behind its merges, and every mistake
(no webserver there, a job or a partition it does not know, a bad run config) is one line.
"""

from __future__ import annotations

from typing import Any

from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.webserver.client import WebserverAPI

PARTITION_TAG = "dagster/partition"

_JOBS = """
query { repositoriesOrError { __typename
  ... on RepositoryConnection { nodes { name location { name } pipelines { name } } }
  ... on PythonError { message } } }
"""

_PARTITIONS = """
query ($selector: PipelineSelector!) { pipelineOrError(params: $selector) { __typename
  ... on Pipeline { partitionKeysOrError { partitionKeys } }
  ... on PipelineNotFoundError { message } ... on PythonError { message } } }
"""

# the mutation dagster_graphql's client sends (its transport waits per read, not in all, and reads any size)
_LAUNCH = """
mutation ($executionParams: ExecutionParams!) { launchPipelineExecution(executionParams: $executionParams) {
  __typename
  ... on LaunchPipelineRunSuccess { run { runId } }
  ... on PipelineConfigValidationInvalid { errors { message } }
  ... on InvalidStepError { invalidStepKey }
  ... on InvalidOutputError { stepKey invalidOutputName }
  ... on Error { message } } }
"""


def queue_merge(url: str, partition: str, *, job: str, run_config: dict[str, Any]) -> str:
    """Queue ``job`` for ``partition`` on the webserver at ``url``; its run id."""
    api = WebserverAPI(url)
    try:
        return _queue(api, partition, job, run_config)
    except (KeyError, TypeError, AttributeError, IndexError):  # JSON objects, but not the API's
        raise api.not_understood() from None


def _queue(api: WebserverAPI, partition: str, job: str, run_config: dict[str, Any]) -> str:
    location, repository = _repository_of(api, job)
    known = api.query(_PARTITIONS, "pipelineOrError", selector=_selector(job, location, repository))
    if "partitionKeysOrError" not in known:
        raise MergeError(None, f"{api.shown}: job {job}: {first_line(known.get('message', known['__typename']))}")
    if partition not in known["partitionKeysOrError"]["partitionKeys"]:
        raise MergeError(
            None,
            f"{api.shown}: job {job} has no partition {partition!r} in this instance (the sensor adds a step once it is "
            "complete: see the partitions of hf_model in the UI)",
        )
    params = {
        "selector": _selector(job, location, repository),
        "runConfigData": run_config,
        "mode": "default",
        "executionMetadata": {"tags": [{"key": PARTITION_TAG, "value": partition}]},
    }
    launched = api.query(_LAUNCH, "launchPipelineExecution", executionParams=params)
    if launched["__typename"] in ("LaunchRunSuccess", "LaunchPipelineRunSuccess"):
        return str(launched["run"]["runId"])
    raise MergeError(None, f"{api.shown}: job {job} not queued: {_launch_error(launched)}")


def _repository_of(api: WebserverAPI, job: str) -> tuple[str, str]:
    answer = api.query(_JOBS, "repositoriesOrError")
    if "nodes" not in answer:
        raise MergeError(None, f"{api.shown}: the code location does not load: {first_line(answer.get('message'))}")
    holders = [
        (r["location"]["name"], r["name"]) for r in answer["nodes"] if job in {p["name"] for p in r["pipelines"]}
    ]
    if len(holders) != 1:
        jobs = sorted({p["name"] for r in answer["nodes"] for p in r["pipelines"] if "merge_checkpoint" in p["name"]})
        found = "in several code locations" if holders else f"here (merge jobs: {', '.join(jobs) or 'none'})"
        raise MergeError(None, f"{api.shown}: no single job {job} {found}: pass --job")
    return holders[0]


def _selector(job: str, location: str, repository: str) -> dict[str, str]:
    return {"pipelineName": job, "repositoryLocationName": location, "repositoryName": repository}


def _launch_error(launched: dict[str, Any]) -> str:
    """The refusal as ``Kind: first problem`` (a config error carries a list of them)."""
    kind = launched["__typename"]
    errors = launched.get("errors")
    problem = (
        errors[0].get("message", "")
        if isinstance(errors, list) and errors
        else launched.get("message") or launched.get("invalidStepKey") or launched.get("invalidOutputName") or ""
    )
    return f"{kind}: {first_line(problem)}" if problem else str(kind)
