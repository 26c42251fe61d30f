"""``merge-pipeline queue KEY``: a merge of one step put in the run queue of a running Dagster webserver.

``dg launch`` runs the merge in its own process, outside the queue, and like ``dagster job launch`` it
answers a wrong instance (no ``DAGSTER_HOME``, another instance's partition) with a traceback. This
asks the webserver the user opened (the UI's own GraphQL API, through ``dagster_graphql``'s public
client), so the run lands in the instance the sensor fills, waits behind its merges, and every mistake
(no webserver there, a job or a partition it does not know, a bad run config) is one line.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import requests
from dagster_graphql import DagsterGraphQLClient, DagsterGraphQLClientError

from merge_pipeline.errors import MergeError, first_line

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


def queue_merge(url: str, partition: str, *, job: str, run_config: dict[str, Any]) -> str:
    """Queue ``job`` for ``partition`` on the webserver at ``url``; its run id."""
    url = url.rstrip("/")
    location, repository = _repository_of(url, job)
    known = _query(url, _PARTITIONS, selector=_selector(job, location, repository))["pipelineOrError"]
    if "partitionKeysOrError" not in known:
        raise MergeError(None, f"{url}: job {job}: {known.get('message', known['__typename'])}")
    if partition not in known["partitionKeysOrError"]["partitionKeys"]:
        raise MergeError(
            None,
            f"{url}: job {job} has no partition {partition!r} in this instance (the sensor adds a step once it is "
            "complete: see the partitions of hf_model in the UI)",
        )
    try:
        return _client(url).submit_job_execution(
            job,
            repository_location_name=location,
            repository_name=repository,
            run_config=run_config,
            tags={PARTITION_TAG: partition},
        )
    except DagsterGraphQLClientError as exc:
        raise MergeError(None, f"{url}: job {job} not queued: {_client_error(exc)}") from None


def _repository_of(url: str, job: str) -> tuple[str, str]:
    answer = _query(url, _JOBS)["repositoriesOrError"]
    if "nodes" not in answer:
        raise MergeError(None, f"{url}: the code location does not load: {first_line(answer.get('message'))}")
    holders = [
        (r["location"]["name"], r["name"]) for r in answer["nodes"] if job in {p["name"] for p in r["pipelines"]}
    ]
    if len(holders) != 1:
        jobs = sorted({p["name"] for r in answer["nodes"] for p in r["pipelines"] if "merge_checkpoint" in p["name"]})
        found = "in several code locations" if holders else f"here (merge jobs: {', '.join(jobs) or 'none'})"
        raise MergeError(None, f"{url}: no single job {job} {found}: pass --job")
    return holders[0]


def _query(url: str, query: str, **variables: Any) -> dict[str, Any]:
    try:
        response = requests.post(f"{url}/graphql", json={"query": query, "variables": variables}, timeout=60)
        response.raise_for_status()
        body = response.json()
    except requests.ConnectionError:
        raise MergeError(
            None, f"{url}: no Dagster webserver listens there: start `dagster dev` or pass --url"
        ) from None
    except requests.Timeout:
        raise MergeError(None, f"{url}: the webserver did not answer within 60 s") from None
    except requests.HTTPError as exc:
        raise MergeError(
            None, f"{url}/graphql: HTTP {exc.response.status_code}: is this a Dagster webserver?"
        ) from None
    except ValueError:
        raise MergeError(None, f"{url}/graphql: the answer is not JSON: is this a Dagster webserver?") from None
    if body.get("errors"):
        raise MergeError(None, f"{url}: {first_line(body['errors'][0].get('message'))}")
    return body["data"]


def _selector(job: str, location: str, repository: str) -> dict[str, str]:
    return {"pipelineName": job, "repositoryLocationName": location, "repositoryName": repository}


def _client(url: str) -> DagsterGraphQLClient:
    parts = urlsplit(url)
    return DagsterGraphQLClient(
        parts.hostname or "127.0.0.1",
        port_number=parts.port,
        use_https=parts.scheme == "https",
        path_prefix=parts.path.rstrip("/"),
    )


def _client_error(exc: DagsterGraphQLClientError) -> str:
    """The client's error as ``Kind: first problem`` (a config error carries a list of them)."""
    kind, *detail = exc.args or (type(exc).__name__,)
    problem = detail[0] if detail else ""
    if isinstance(problem, list):
        problem = problem[0].get("message", "") if problem else ""
    return f"{kind}: {first_line(problem)}" if problem else str(kind)
