"""The numeric settings (settle time, sensor interval, freshness window), checked in one place, the
same way whether they come from the component's ``defs.yaml`` or from the environment.

A value that is not a finite number at or above the setting's minimum (``abc``, ``10s``, ``nan``,
``inf``, ``-5``) fails the code location's load in one line naming the setting (the variable, or the
``defs.yaml`` field), the value, and what is expected with its unit: ``nan`` or ``inf`` would wait
forever, a negative settle time would switch the wait off.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass

import dagster as dg

from merge_pipeline.errors import MergeError


@dataclass(frozen=True)
class NumericSetting:
    """One numeric setting: its ``defs.yaml`` field, its environment variable, its unit and its bounds."""

    field: str
    variable: str
    default: float
    unit: str
    minimum: float = 0
    whole: bool = False  # a whole number (Dagster takes the sensor interval as an int)

    def checked(self, value: object, named: str | None = None) -> float:
        """``value`` (a ``defs.yaml`` number or an environment variable's text) as a number; ``MergeError``
        in one line naming the setting (``named``, else the field), the value and what is expected."""
        try:
            number = math.nan if isinstance(value, bool) else float(value)  # YAML's true is no number of seconds
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not self.minimum <= number < math.inf or (self.whole and not number.is_integer()):
            kind = "a whole number" if self.whole else "a finite number"
            raise MergeError(
                None,
                f"{named or self.field} is {reprlib.repr(value)}: expected {kind} of {self.unit} >= {self.minimum:g}",
            )
        return int(number) if self.whole else number

    def from_env(self) -> float:
        """The environment's value, checked; the default when the variable is unset."""
        text = dg.EnvVar(self.variable).get_value()
        return self.default if text is None else self.checked(text, self.variable)

    def of(self, value: float | None) -> float:
        """A ``defs.yaml`` / resource field's value, or the environment's when the field is unset (None)."""
        return self.from_env() if value is None else self.checked(value)


SETTLE = NumericSetting("settle_seconds", "MERGE_PIPELINE_SETTLE_SECONDS", 60, "seconds")
SENSOR_INTERVAL = NumericSetting(
    "sensor_interval_seconds", "MERGE_PIPELINE_SENSOR_INTERVAL_SECONDS", 10, "seconds", whole=True
)
# Dagster refuses a freshness window under a minute
FRESHNESS = NumericSetting("freshness_minutes", "MERGE_PIPELINE_FRESHNESS_MINUTES", 30, "minutes", minimum=1)
NUMERIC_SETTINGS = {s.field: s for s in (SETTLE, SENSOR_INTERVAL, FRESHNESS)}  # by defs.yaml field
