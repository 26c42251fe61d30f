"""Every setting of the ``MergeCheckpoints`` component, declared once: its name (the ``defs.yaml``
attribute and the resource field), its environment variable, its default, its help and its check.

Each is of a ``Kind`` of ``merge_pipeline.settings`` (where the engine's own variables are declared). From
this one list come the component's attributes (``component.py``; the Hub's under its ``hub:``),
the fields of the ``settings``, ``alert_webhook`` and ``hub`` resources (``resources.py``, ``alerts.py``,
``hub_model.py``), the ``defs.yaml`` the scaffolder writes, and the table in docs/DAGSTER.md ("Configuration":
``python -m merge_pipeline.watch.location_settings`` prints it; a test holds the two equal).

An attribute left out is read from its variable, when a run or a sensor tick uses it, or for the
settings that shape the definitions (``at_load``) when the code location loads; with neither, the
default. A value that does not pass its check (``abc``, ``10s``, ``nan``, ``inf``, ``-5`` seconds, a
size of ``0GB``) fails the location's load in one line naming the variable or the ``defs.yaml``
attribute, the value and what is expected: ``nan`` or ``inf`` would wait forever, a negative settle
time would switch the wait off.
"""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path
from typing import Any

from pydantic import BaseModel, create_model

from merge_pipeline.hf.evaluation_result import BestBy, Threshold
from merge_pipeline.hf.smoke_test import DEFAULT_PROMPT
from merge_pipeline.hub.connection import DEFAULT_ENDPOINT
from merge_pipeline.settings import (
    DAY_SECONDS,
    HUB_TIMEOUT,
    OPTIONAL_PATH,
    OPTIONAL_TEXT,
    SECONDS,
    SIZE,
    SWITCH,
    TEXT,
    Kind,
    Setting,
    choice,
    number,
)
from merge_pipeline.store.listing import Folder, folder_or_url
from merge_pipeline.watch.keys import PINS


def _folders_or_urls(value: Any, named: str) -> list[Folder]:
    roots = _split_roots(value) if isinstance(value, str) else value
    return [folder_or_url(r) for r in roots if r]


def _split_roots(setting: str) -> list[str]:
    """os.pathsep-separated roots, where a URL's own ``:`` (``s3://bucket/prefix``) separates nothing."""
    roots: list[str] = []
    for part in setting.split(os.pathsep):
        if roots and part.startswith("//") and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", roots[-1]):
            roots[-1] += os.pathsep + part
        else:
            roots.append(part)
    return roots


THRESHOLD = Kind(str, Threshold.parse, checked_at_load=True)
BEST_BY = Kind(str, BestBy.parse, checked_at_load=True)
FOLDERS_OR_URLS = Kind(list[str], _folders_or_urls)
FOLDER_OR_URL = Kind(str, lambda value, named: folder_or_url(value))


CHECKPOINT_ROOTS: Setting[list[Folder]] = Setting(
    "MERGE_PIPELINE_CHECKPOINT_ROOTS",
    FOLDERS_OR_URLS,
    "./demo/checkpoints",
    "folders or store prefixes (s3://bucket/prefix) watched for checkpoints; the variable: os.pathsep-separated",
    example="[/data/{prefix}/checkpoints]",
    name="checkpoint_roots",
)
OUTPUT_ROOT: Setting[Folder] = Setting(
    "MERGE_PIPELINE_OUTPUT_ROOT",
    FOLDER_OR_URL,
    "./demo/merged",
    "merged HF folders land in <output_root>/<partition key>/ (the checkpoint folder's path below its watched root)",
    example="/data/{prefix}/merged",
    name="output_root",
)
SETTLE_SECONDS: Setting[float] = Setting(
    "MERGE_PIPELINE_SETTLE_SECONDS",
    SECONDS,
    "60",
    "without the trainer's tracker file, a step is complete once no file under it changed for this long",
    example="60",
    name="settle_seconds",
)
HF_MODEL_PATH: Setting[str | None] = Setting(
    "MERGE_PIPELINE_HF_MODEL_PATH",
    OPTIONAL_TEXT,
    None,
    "the original HF model folder for checkpoints that hold no config of their own (a merge that needs "
    "it says so), so the sensor's runs merge them; a run config's hf_model_path wins",
    name="hf_model_path",
)
PIN_STEPS: Setting[bool] = Setting(
    "MERGE_PIPELINE_PIN_STEPS",
    SWITCH,
    "0",
    "hard-link a complete step into a pin folder when its merge is requested, so the trainer's rotation "
    "cannot delete it before it is merged; the pin is removed once published or failed (the variable: 1/true)",
    example="false",
    name="pin_steps",
)
PIN_ROOT: Setting[Path | None] = Setting(
    "MERGE_PIPELINE_PIN_ROOT",
    OPTIONAL_PATH,
    None,
    "where pins lie: a folder of this user's (made 0700 if absent; each deployment's pins in a 0700 folder "
    "of their own), on the checkpoints' filesystem (hard links do not cross filesystems)",
    unset=f"<checkpoint root>/{PINS}",
    name="pin_root",
)
SMOKE_TEST: Setting[bool] = Setting(
    "MERGE_PIPELINE_SMOKE_TEST",
    SWITCH,
    "0",
    "after the merge, load the folder with transformers on CPU, greedy-generate a few tokens for "
    "smoke_prompt and measure the loss on a short fixed text (step_report and the model card; the variable: 1/true)",
    example="false",
    name="smoke_test",
)
SMOKE_TEST_PROMPT: Setting[str] = Setting(
    "MERGE_PIPELINE_SMOKE_PROMPT",
    TEXT,
    DEFAULT_PROMPT,
    "the smoke test's prompt",
    name="smoke_prompt",
)
SMOKE_MAX_SIZE: Setting[int] = Setting(
    "MERGE_PIPELINE_SMOKE_MAX_SIZE",
    SIZE,
    "2GB",  # the model is loaded whole, on CPU, in the run's process: a 1B bf16 model fits
    "folders with more weight bytes than this skip the smoke test (loaded whole)",
    example="2GB",
    name="smoke_max_size",
)
ALERT_WEBHOOK_URL: Setting[str | None] = Setting(
    "MERGE_PIPELINE_ALERT_WEBHOOK_URL",
    OPTIONAL_TEXT,
    None,
    "where merge_failure_webhook posts a failed run",
    resource="alert_webhook",
    unset="no alerts",
    name="alert_webhook_url",
)
SENSOR_INTERVAL_SECONDS: Setting[int] = Setting(
    "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS",
    number("seconds", whole=True, maximum=DAY_SECONDS),
    "10",
    "minimum time between sensor ticks (the daemon loops every 5 s at best)",
    resource=None,
    name="sensor_interval_seconds",
)
FRESHNESS_MINUTES: Setting[float] = Setting(
    "MERGE_PIPELINE_FRESHNESS_MINUTES",
    number("minutes", minimum=1, maximum=366 * 24 * 60),  # Dagster refuses a freshness window under a minute
    "30",
    "hf_model's freshness policy: stale when no step was published for this long",
    resource=None,
    name="freshness_minutes",
)
# The evaluation of each merged step (dagster/evaluation.py): the `evaluation` asset, run through Dagster Pipes.
EVALUATION_COMMAND: Setting[str | None] = Setting(
    "MERGE_PIPELINE_EVALUATION_COMMAND",
    OPTIONAL_TEXT,
    None,
    "the evaluation's command line, run through Dagster Pipes in a subprocess with the merged folder as "
    "{folder} and the Pipes extra 'folder'; it reports its metrics as materialization metadata",
    unset="python -m merge_pipeline.dagster.smoke_evaluation (the smoke test's loss on a fixed text, CPU)",
    name="evaluation_command",
)
EVALUATION_THRESHOLD: Setting[str | None] = Setting(
    "MERGE_PIPELINE_EVALUATION_THRESHOLD",
    THRESHOLD,
    None,
    "'<metric> <= <number>' or '<metric> >= <number>': a blocking check of the evaluation, and the Hub "
    "publishes only steps whose evaluation met it",
    resource=None,
    unset="no threshold",
    name="evaluation_threshold",
)
PROMOTE_BEST_BY: Setting[str | None] = Setting(
    "MERGE_PIPELINE_PROMOTE_BEST_BY",
    BEST_BY,
    None,
    "'<metric> max' or '<metric> min': the sensor promote_best_steps promotes each run's evaluated step with "
    "the best value of that metric (ties: the newest step), never one that missed evaluation_threshold",
    resource=None,
    unset="no automatic promotion",
    name="promote_best_by",
)
# Publishing to a Hugging Face Hub (dagster/hub_model.py): the `hub` resource, the component's `hub:` section;
# its timeout, which the CLI's upload reads too, is settings.HUB_TIMEOUT.
HUB_ORG: Setting[str] = Setting(
    "MERGE_PIPELINE_HUB_ORG",
    TEXT,
    "",
    "Hub namespace (user or organization) to publish under; empty: publishing is off (its schedules stay "
    "stopped, hub_model records nothing)",
    resource="hub",
    under="hub",
    example='""',
    name="organization",
)
HUB_PRIVATE: Setting[bool] = Setting(
    "MERGE_PIPELINE_HUB_PRIVATE",
    SWITCH,
    "1",
    "create new repos private (an existing repo keeps its visibility; the variable: 1/true or 0/false)",
    resource="hub",
    under="hub",
    name="private",
)
HUB_REPO_TEMPLATE: Setting[str] = Setting(
    "MERGE_PIPELINE_HUB_REPO_TEMPLATE",
    TEXT,
    "{org}/{run_name}-{role}",
    "repo id of a checkpoint, from {org}, {run_name}, {role} and {step}",
    resource="hub",
    under="hub",
    name="repo_template",
)
HUB_REVISIONS: Setting[str] = Setting(
    "MERGE_PIPELINE_HUB_REVISIONS",
    choice("branch", "commit"),
    "branch",
    "branch: one branch per step, named as the step folder its trainer wrote (the partition key's step "
    "part); commit: one commit per step on main",
    resource="hub",
    under="hub",
    name="revisions",
)
HUB_ENDPOINT: Setting[str | None] = Setting(
    "HF_ENDPOINT",
    OPTIONAL_TEXT,
    None,
    "the Hub's URL",
    resource="hub",
    under="hub",
    unset=DEFAULT_ENDPOINT,
    name="endpoint",
)
HUB_TOKEN: Setting[str | None] = Setting(
    "HF_TOKEN",
    OPTIONAL_TEXT,
    None,
    "access token, from its variable only (never in defs.yaml or plain config: the resource takes "
    "EnvVar('HF_TOKEN'), whose name the UI shows)",
    resource="hub",
    under="hub",
    unset="the stored `hf auth login`",
    secret=True,
    name="token",
)
SETTINGS = (
    CHECKPOINT_ROOTS,
    OUTPUT_ROOT,
    SETTLE_SECONDS,
    HF_MODEL_PATH,
    PIN_STEPS,
    PIN_ROOT,
    SMOKE_TEST,
    SMOKE_TEST_PROMPT,
    SMOKE_MAX_SIZE,
    ALERT_WEBHOOK_URL,
    SENSOR_INTERVAL_SECONDS,
    FRESHNESS_MINUTES,
    EVALUATION_COMMAND,
    EVALUATION_THRESHOLD,
    PROMOTE_BEST_BY,
    HUB_ORG,
    HUB_PRIVATE,
    HUB_REPO_TEMPLATE,
    HUB_REVISIONS,
    HUB_ENDPOINT,
    HUB_TIMEOUT,
    HUB_TOKEN,
)
BY_NAME = {s.name: s for s in SETTINGS}


def of_resource(resource: str) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.resource == resource)


def attributes(under: str | None = None) -> tuple[Setting, ...]:
    """The settings that are attributes of the component (``under``: of that section of it)."""
    return tuple(s for s in SETTINGS if s.under == under and not s.secret)


def with_fields(base: type[BaseModel], settings: tuple[Setting, ...], field=Setting.field) -> type[BaseModel]:
    """``base`` with one field per setting (``field``: the setting's type and pydantic field), for a
    resource or the component to subclass."""
    return create_model(f"{base.__name__}Settings", __base__=base, **{s.name: field(s) for s in settings})


def docs_table() -> str:
    """The table docs/DAGSTER.md shows under "Configuration"."""
    rows = ["| variable | `defs.yaml` attribute | default | read | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        read = "at load" if s.at_load else "per run / tick"
        meaning = s.help.replace("<", "\\<")  # <output_root> is no HTML tag
        default = s.shown_default.replace("<", "\\<")
        attribute = "none: the variable only" if s.secret else f"`{s.attribute}`"
        rows.append(f"| `{s.variable}` | {attribute} | {default} | {read} | {meaning} |")
    return "\n".join(rows) + "\n"


def scaffold_lines(prefix: str, under: str | None = None) -> list[str]:
    """The scaffolded ``defs.yaml``'s lines of every setting at the top level (``under``: in that section):
    its description as a comment, then the attribute set to its example, or left out (commented, reading
    the variable) where it has none; a secret only as a comment (its variable is the one way in)."""
    lines = []
    for s in SETTINGS:
        if s.under != under:
            continue
        lines += textwrap.wrap(s.description, 96, initial_indent="# ", subsequent_indent="# ")
        if not s.secret:
            lines.append(f"{s.name}: {s.example.format(prefix=prefix)}" if s.example else f"# {s.name}:")
    return lines


if __name__ == "__main__":  # python -m merge_pipeline.watch.location_settings: the table docs/DAGSTER.md shows
    print(docs_table(), end="")
