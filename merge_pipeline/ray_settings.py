"""What a merge on a Ray cluster asks of it, described once: ``merge --ray-*`` flags and Dagster's ``ray_*`` fields.

No Ray here: the CLI and the code location build their flags and config from these fields without it;
``ray_tasks`` imports Ray when a merge runs there.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from merge_pipeline.errors import MergeError
from merge_pipeline.settings import described, parse_size


@dataclass(frozen=True)
class RaySettings:
    address: str = described(
        "auto",
        "the Ray cluster: the head's host:port (ray start --head prints it), ray://HOST:10001 for Ray Client"
        " (a KubeRay head service), or auto (RAY_ADDRESS, else the cluster this machine is a node of)",
        metavar="ADDR",
    )
    cpus_per_task: float = described(1.0, "CPUs each write task reserves (it asks for no GPU)", metavar="N")
    memory_per_task: str | None = described(
        None,
        "memory each write task reserves, HF-style (e.g. 8GB); default: from the plan, its largest tensor twice"
        " plus the writer's buffers and the process",
        metavar="SIZE",
    )
    resource: str | None = described(
        None,
        "a custom resource each write task takes one unit of, to keep merges on the nodes that offer it"
        " (ray start --resources '{\"merge\": 4}')",
        metavar="NAME",
    )
    node_label: str | None = described(
        None, "only nodes with this label run write tasks (ray start --labels)", metavar="KEY=VALUE"
    )
    tasks: int | None = described(
        None, "write tasks, each a set of whole weight files (default: one per node that can run one)", metavar="N"
    )
    max_retries: int = described(3, "times a task whose node or worker died is run again, on another node", metavar="N")
    timeout: float = described(
        600.0,
        "fail when no weight byte was written for this long (tasks waiting for resources, a hung node)",
        metavar="SECONDS",
    )

    env_vars: list[str] | None = described(
        None,
        "environment variables given to the write tasks, by name (their values: this process's, at launch; never"
        " printed); default, for a merge that reads or writes a store: those of the store's and the Hub's that are"
        " set here (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, STORAGE_EMULATOR_HOST, HF_TOKEN, HF_ENDPOINT,"
        " MERGE_PIPELINE_*); none: forward nothing",
        metavar="NAME",
        nargs="*",
    )

    def __post_init__(self) -> None:
        if not self.address.strip():
            raise MergeError(None, "--ray-address: empty; give the head's HOST:PORT, ray://HOST:10001 or auto")
        if not self.cpus_per_task > 0:
            raise MergeError(None, f"--ray-cpus-per-task {self.cpus_per_task:g}: must be a positive number")
        if self.memory_per_task is not None:
            parse_size(self.memory_per_task, "--ray-memory-per-task")
        if self.node_label is not None and not _label_pair(self.node_label):
            raise MergeError(None, f"--ray-node-label {self.node_label!r}: expected KEY=VALUE")
        if self.tasks is not None and self.tasks < 1:
            raise MergeError(None, f"--ray-tasks {self.tasks}: must be at least 1")
        if self.max_retries < 0:
            raise MergeError(None, f"--ray-max-retries {self.max_retries}: must be 0 or more")
        if not self.timeout > 0:
            raise MergeError(None, f"--ray-timeout {self.timeout:g}: must be a positive number of seconds")
        for name in self.env_vars or ():
            if not _ENV_NAME.fullmatch(name):
                raise MergeError(None, f"--ray-env-vars {name!r}: not an environment variable's name")

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory_per_task is None else parse_size(self.memory_per_task, "--ray-memory-per-task")

    @property
    def label_selector(self) -> dict[str, str]:
        return dict([_label_pair(self.node_label)]) if self.node_label else {}

    def forwarded_env(self, uses_store: bool, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """The variables the write tasks get (Ray's ``runtime_env`` ``env_vars``): those named, or by default
        the store's and the Hub's where the merge uses a store; only those set in ``environ``."""
        if self.env_vars is not None:
            names = self.env_vars
        else:
            names = [n for n in environ if n in STORE_VARIABLES or n.startswith(_OWN_PREFIX)] if uses_store else []
        return {name: environ[name] for name in names if name in environ}


# What s3fs, gcsfs and huggingface_hub read from the environment: a Ray node started without them cannot
# reach the store (every task fails with "Unable to locate credentials").
STORE_VARIABLES = frozenset(
    {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
        "AWS_CA_BUNDLE",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "STORAGE_EMULATOR_HOST",
        "HF_TOKEN",
        "HF_ENDPOINT",
    }
)
_OWN_PREFIX = "MERGE_PIPELINE_"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _label_pair(text: str) -> tuple[str, str] | None:
    key, equals, value = text.partition("=")
    return (key.strip(), value.strip()) if equals and key.strip() and value.strip() else None


RAY_FIELDS = fields(RaySettings)
