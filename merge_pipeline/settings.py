"""Every knob read from the environment, one record type (``Setting``): how its value is read and checked
(``Kind``), and the variables the engine, the stores and the CLI read, each declared once with its unit,
bounds and default. Every ``MERGE_PIPELINE_*`` variable is read here, by ``Setting.value``.

A variable is read where it is used, never at import: a bad ``MERGE_PIPELINE_PART_BYTES`` is refused by
the upload that needs it, in one line naming the variable, the value, its unit and bounds, and every
command that needs none (``inspect`` of a local folder) runs. The Dagster component's settings
(``watch/location_settings.py``) are records of the same type. Numbers are finite and bounded (``1e300``
minutes or seconds would overflow a timedelta or a socket's timeout); sizes take ``33554432``,
``32MiB`` or ``4GB``.

The schema helpers every record type shares live here too: ``described`` (a field with its help, for
``MergeOptions`` and ``RaySettings``) and ``parse_size``.
"""

from __future__ import annotations

import math
import os
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from merge_pipeline.errors import MergeError

T = TypeVar("T")

_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def described(default, help: str, **cli):
    """A dataclass field with its default and help text; ``cli``: its CLI spellings (``flags``, ``metavar``,
    ``nargs``) and, for an option, its commands and choices. The CLI's flags and Dagster's config are built from them."""
    return field(default=default, metadata={"help": help, **cli})


def parse_size(size: str | int, flag: str) -> int:
    """Bytes, at least 1, from an int or an HF-style size ("64MB", "1.5GB"; decimal units; "32MiB" binary)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d{1,15}(?:\.\d{1,15})?)\s*([KMGT]i?B)?\s*", str(size), re.IGNORECASE)
        if not match:
            raise MergeError(None, f"{flag} {size!r}: expected a size such as 64MB or 1GB")
        value = int(float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "B").upper()])
    if value < 1:
        raise MergeError(None, f"{flag} {size!r}: must be at least 1 byte")
    return value


@dataclass(frozen=True)
class Kind:
    """What a setting holds: its type in ``defs.yaml`` and the resource, and how a value (the attribute's,
    or the variable's text) becomes what the code uses, checked (``MergeError`` naming ``named``)."""

    type: Any
    parse: Callable[[Any, str], Any]
    checked_at_load: bool = False  # a value that can be wrong (a number, a size): checked when the location loads


def number(unit: str, minimum: float = 0, whole: bool = False, above: bool = False, maximum: float = math.inf) -> Kind:
    """A finite number of ``unit`` at or above ``minimum`` (``above``: and not ``minimum`` itself, as a
    timeout of 0 s; ``whole``: a count, or Dagster's int sensor interval) and at most ``maximum``."""

    def parse(value: Any, named: str) -> float:
        try:
            parsed = math.nan if isinstance(value, bool) else float(value)  # YAML's true is no number of seconds
        except (TypeError, ValueError, OverflowError):
            parsed = math.nan
        if (
            not minimum <= parsed <= maximum
            or not math.isfinite(parsed)
            or (above and parsed == minimum)
            or (whole and not parsed.is_integer())
        ):
            kind = "a whole number" if whole else "a finite number"
            bound = f"> {minimum:g}" if above else f">= {minimum:g}"
            bound += f" and <= {maximum:g}" if maximum < math.inf else ""
            raise MergeError(None, f"{named} is {reprlib.repr(value)}: expected {kind} of {unit} {bound}")
        return int(parsed) if whole else parsed

    return Kind(int if whole else float, parse, checked_at_load=True)


def choice(*options: str) -> Kind:
    """One of ``options``, as written."""

    def parse(value: Any, named: str) -> str:
        if value not in options:
            raise MergeError(None, f"{named} is {reprlib.repr(value)}: expected one of {', '.join(options)}")
        return value

    return Kind(str, parse, checked_at_load=True)  # Dagster config has no optional Literal


def size(minimum: int = 1, maximum: int = 1 << 50) -> Kind:
    """Bytes: a count (``33554432``) or a size (``32MiB``, ``64MB``), from ``minimum`` to ``maximum``."""

    def parse(value: Any, named: str) -> int:
        try:
            parsed = parse_size(value, named)
        except MergeError:
            parsed = 0
        if not minimum <= parsed <= maximum:
            raise MergeError(
                None,
                f"{named} is {reprlib.repr(value)}: expected a size in bytes (33554432, 32MiB, 64MB) from"
                f" {_bytes(minimum)} to {_bytes(maximum)}",
            )
        return parsed

    return Kind(str, parse, checked_at_load=True)


def _bytes(count: int) -> str:
    for unit, scale in (("PiB", 1 << 50), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale and count % scale == 0:
            return f"{count // scale}{unit}"
    return f"{count} B"


_SWITCHED = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _switch(value: Any, named: str) -> bool:
    """A YAML boolean or a variable's word; any other word is refused (a private repo is no guess)."""
    if isinstance(value, bool):
        return value
    if str(value).strip().lower() not in _SWITCHED:
        raise MergeError(None, f"{named} is {reprlib.repr(value)}: expected true or false (1 or 0)")
    return _SWITCHED[str(value).strip().lower()]


def _optional_path(value: Any, named: str) -> Path | None:
    return Path(value).absolute() if value else None


DAY_SECONDS = 24 * 3600
SECONDS = number("seconds", maximum=7 * DAY_SECONDS)
SWITCH = Kind(bool, _switch, checked_at_load=True)
TEXT = Kind(str, lambda value, named: value)
OPTIONAL_TEXT = Kind(str, lambda value, named: value or None)
OPTIONAL_PATH = Kind(str, _optional_path)
SIZE = size()


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One knob read from the environment: its variable, kind, default (as the variable would say it; None:
    none) and help. Where it is also the code location's (``watch/location_settings.py``): its ``name``
    there (the ``defs.yaml`` attribute and the resource field) and how the component and its scaffolder
    show it. Every variable is read here, where used (``value``), never at import."""

    variable: str
    kind: Kind
    default: str | None
    help: str
    name: str | None = None  # the defs.yaml attribute and the resource field; None: a variable only
    resource: str | None = "settings"  # the resource holding it; None: it shapes the definitions, read at load
    example: str | None = None  # what the scaffolded defs.yaml sets ({prefix}: the instance's); None: left out
    unset: str | None = None  # what no value at all means, where the default does not say it
    # The defs.yaml mapping its attribute sits in (hub:); None: the top level. A section is resolved when the
    # location loads: the Hub's organization decides whether its schedules run and its averaged asset exists.
    under: str | None = None
    # Read from its variable only, never a defs.yaml attribute: the resource takes it as an EnvVar, so
    # neither the file nor the UI's resource config ever holds the value (a token).
    secret: bool = False

    def value(self, given: Any = None, named: str | None = None) -> T:
        """``given`` (a flag's or an attribute's value, named ``named``, else by its name), else the
        variable's, else the default; checked (one line naming where the bad value came from)."""
        if given is not None:
            return self.kind.parse(given, named or self.name or self.variable)
        text = os.environ.get(self.variable)
        if text is not None:
            return self.kind.parse(text, self.variable)
        return None if self.default is None else self.kind.parse(self.default, self.name or self.variable)

    @property
    def at_load(self) -> bool:
        return (self.resource is None or self.under is not None) and not self.secret

    @property
    def attribute(self) -> str:
        """Its name in ``defs.yaml``, with its section's (``hub.private``)."""
        return f"{self.under}.{self.name}" if self.under else str(self.name)

    def check(self, value: Any) -> Any:
        """A ``defs.yaml`` attribute's value, as given, once it passed the check (one line naming it)."""
        if value is not None and self.kind.checked_at_load:
            self.kind.parse(value, f"defs.yaml {self.attribute}")
        return value

    @property
    def shown_default(self) -> str:
        return self.unset or (
            "none"
            if self.default is None
            else repr(self.default)
            if " " in self.default or not self.default
            else self.default
        )

    @property
    def description(self) -> str:
        """The resource field's description (the UI shows it) and the scaffolded attribute's comment."""
        return f"{self.help}; unset: ${self.variable}, else {self.shown_default}"

    def field(self) -> tuple[Any, Any]:
        """The attribute / resource field: its type or None (left out: the variable's, then the default)."""
        from pydantic import Field  # the code location's; the CLI never builds one

        return self.kind.type | None, Field(default=None, description=self.description)


# Stores (merge_pipeline/store/).
MAX_DOWNLOAD_BYTES: Setting[int] = Setting(
    "MERGE_PIPELINE_MAX_DOWNLOAD_BYTES",
    size(),
    "4GiB",
    "a store prefix holding more bytes of files that are not weight files (downloaded whole) is refused",
)
PART_BYTES: Setting[int] = Setting(
    "MERGE_PIPELINE_PART_BYTES",
    size(5 << 20, 5 << 30),  # S3's bounds on a multipart upload's part
    "32MiB",
    "uploads go up in parts of this size",
)
PARALLEL_UPLOADS: Setting[int] = Setting(
    "MERGE_PIPELINE_PARALLEL_UPLOADS",
    number("files", minimum=1, whole=True, maximum=64),
    "4",
    "weight files uploaded at once (and written, not yet uploaded, on local disk)",
)
PARTS_IN_FLIGHT: Setting[int] = Setting(
    "MERGE_PIPELINE_PARTS_IN_FLIGHT",
    number("parts", minimum=1, whole=True, maximum=64),
    "2",
    "parts of each uploaded file in flight at once",
)
PREFETCH_BYTES: Setting[int] = Setting(
    "MERGE_PIPELINE_PREFETCH_BYTES",
    size(maximum=64 << 30),
    "64MiB",
    "bytes of input objects read ahead, held or in flight",
)
LIST_PAGE_KEYS: Setting[int] = Setting(
    "MERGE_PIPELINE_LIST_PAGE_KEYS",
    number("keys", minimum=1, whole=True, maximum=1000),  # S3's own maximum per request
    "1000",
    "keys asked for per listing request",
)
SCRATCH: Setting[Path | None] = Setting(
    "MERGE_PIPELINE_SCRATCH",
    OPTIONAL_PATH,
    None,
    "where a merge into a store builds its folder (default ~/.cache/merge_pipeline/store-targets)",
)
# Waits.
HUB_TIMEOUT: Setting[float] = Setting(
    "MERGE_PIPELINE_HUB_TIMEOUT",
    number("seconds", above=True, maximum=DAY_SECONDS),
    "60",
    "seconds a Hub request may wait to connect or for an answer",
    name="timeout_s",  # the component's hub: timeout_s, the hub resource's field
    resource="hub",
    under="hub",
)
DIST_TIMEOUT: Setting[float] = Setting(
    "MERGE_PIPELINE_DIST_TIMEOUT",
    number("seconds", above=True, maximum=7 * DAY_SECONDS),
    "1800",
    "under torchrun: how long ranks wait for a silent peer",
)
