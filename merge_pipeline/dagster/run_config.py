"""Per-run merge options, set in the Launchpad (or a sensor's run config) for ``hf_model``.

Every ``MergeOptions`` field is a config field here, with the CLI's help as its description and the
same default; so is every ``RaySettings`` field, as ``ray_<name>``; the other launcher fields are Dagster's own.
The launcher's fields (``LauncherConfig``) are averaged_model's too (``writer_fields``), so an average is
written where a merge is.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_type_hints

import dagster as dg
from pydantic import Field, create_model
from pydantic.fields import FieldInfo

from merge_pipeline.errors import MergeError
from merge_pipeline.options import OPTION_FIELDS, MergeOptions
from merge_pipeline.ray_settings import RAY_FIELDS, RaySettings


def _config_type(option: dataclasses.Field) -> object:
    """Dagster's config types have no unions but Optional: sizes are given as strings there (5GB, 500MB)."""
    if option.metadata["choices"]:
        return Literal[option.metadata["choices"]]
    if isinstance(option.default, tuple):  # a list of names (quantize_ignore)
        return list[str]
    return str | None if option.default is None else type(option.default)


def config_field(option: dataclasses.Field, description: str | None = None) -> FieldInfo:
    """A described field (``settings.described``) as a config field: its default (a tuple as a list) and its
    help as the description (``description``: a schema's own words for it)."""
    default = list(option.default) if isinstance(option.default, tuple) else option.default
    return Field(default=default, description=description or option.metadata["help"])


_MergeOptionsConfig = create_model(
    "_MergeOptionsConfig",
    __base__=dg.Config,
    **{option.name: (_config_type(option), config_field(option)) for option in OPTION_FIELDS},
)


class _Launcher(dg.Config):
    launcher: Literal["inprocess", "torchrun", "ray"] = Field(
        default="inprocess",
        description="write the shards in the run's process, across processes (and nodes) with torchrun, or as tasks on a Ray cluster (ray_address)",
    )
    nproc_per_node: int = Field(default=2, ge=1, description="torchrun: processes on this node")
    nnodes: int = Field(
        default=1,
        ge=1,
        description="torchrun: nodes; the others run the same command with their --node-rank (see README)",
    )
    rdzv_endpoint: str = Field(default="127.0.0.1:29400", description="torchrun: rendezvous host:port when nnodes > 1")


# The Ray launcher's settings, each as ray_<name>: the CLI's --ray-<name> with the same help and default.
_LauncherAndRay = create_model(
    "_LauncherAndRay",
    __base__=_Launcher,
    **{
        f"ray_{setting.name}": (
            get_type_hints(RaySettings)[setting.name],
            config_field(setting, f"launcher ray: {setting.metadata['help']}"),
        )
        for setting in RAY_FIELDS
    },
)


class LauncherConfig(_LauncherAndRay):
    """Who writes the weights (``workers.workers_for``): every step that writes a folder takes these
    fields, hf_model's merge and averaged_model's average alike."""

    def ray_settings(self) -> RaySettings:
        return RaySettings(**{setting.name: getattr(self, f"ray_{setting.name}") for setting in RAY_FIELDS})

    def launcher_label(self) -> str:
        """What the metadata says wrote the weights."""
        if self.launcher == "torchrun":
            return f"torchrun x{self.nproc_per_node * self.nnodes}"
        return f"ray at {self.ray_address}" if self.launcher == "ray" else self.launcher


class MergeConfig(LauncherConfig, _MergeOptionsConfig):  # fields: the options, then the launcher's
    def options(self) -> MergeOptions:
        return MergeOptions(**{option.name: getattr(self, option.name) for option in OPTION_FIELDS})


# What decides how a step's weights are written and by whom: the launcher, and the files they share.
WRITER_FIELDS = ("max_shard_size", *LauncherConfig.model_fields)


def writer_fields(merge_config: dict) -> dict:
    """``MergeConfig``'s ``WRITER_FIELDS`` for another step's config (``create_model``, on ``LauncherConfig``),
    with the merge step's values (a checked ``merge_config``) as their defaults: so averaged_model's weights
    are written as the sensor's merges are, on the same launcher, and a run may still pick another."""
    return _defaulted(merge_config, WRITER_FIELDS)


def merge_config_class(merge_config: dict) -> type[MergeConfig]:
    """``hf_model``'s config with a component's (checked) ``merge_config`` as its defaults: a run started
    without config (the UI's Materialize, ``dg launch``, ``merge-pipeline queue``) merges as the sensor's do."""
    return create_model("MergeConfig", __base__=MergeConfig, **_defaulted(merge_config, MergeConfig.model_fields))


def overridden(config: MergeConfig) -> list[str]:
    """The fields a run's config sets otherwise than its step's defaults, as ``name=value (default: value)``."""
    defaults = type(config)()
    return [
        f"{name}={getattr(config, name)!r} (default: {getattr(defaults, name)!r})"
        for name in type(config).model_fields
        if getattr(config, name) != getattr(defaults, name)
    ]


def _defaulted(merge_config: dict, names) -> dict:
    return {
        name: (field.annotation, FieldInfo.merge_field_infos(field, default=merge_config.get(name, field.default)))
        for name, field in MergeConfig.model_fields.items()
        if name in names
    }


def checked_merge_config(fields: dict) -> dict:
    """``hf_model``'s config given outside a run (a component's ``merge_config``): an unknown field or a bad
    value is refused when the definitions load, not by every merge after."""
    unknown = sorted(set(fields) - set(MergeConfig.model_fields))
    if unknown:
        raise MergeError(None, f"merge_config: unknown field(s) {', '.join(unknown)}: see the hf_model step's config")
    config = MergeConfig(**fields)
    config.options()
    if config.launcher == "ray":
        config.ray_settings()
    return fields
