"""Print a pip constraints file that holds each lower bound in pyproject.toml at its own release.

    python scripts/lower_bounds.py EXTRA...   the project's dependencies and those of the named extras

pip has no lowest-versions mode: `pip install -c <this> .` installs the oldest release of every direct
dependency that the project says it supports (scripts/setup_lowest.sh).
"""

import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, a dependency of dagster's
    import tomli as tomllib

from packaging.requirements import Requirement


def lower_bounds(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e])]
    pins = {}
    for line in requirements:
        requirement = Requirement(line)
        lower = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
        if lower:
            pins[requirement.name] = f"{requirement.name}=={lower[0]}"
    return sorted(pins.values())


if __name__ == "__main__":
    print("\n".join(lower_bounds(Path(__file__).resolve().parent.parent / "pyproject.toml", sys.argv[1:])))
