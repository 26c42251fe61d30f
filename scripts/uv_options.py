"""Print, one a line, the `uv pip install` options that make uv choose what pip chooses here.

    python scripts/uv_options.py

uv reads no pip.conf and no PIP_* variable: the indexes, find-links and constraints pip is configured with
(`pip config list`; a variable wins over a file) become uv's options. pip takes the best version across all
its indexes, uv by default the first index that has the package: `--index-strategy unsafe-best-match` is pip's.
"""

import shlex
import subprocess
import sys

OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
OPTIONS |= {"constraint": "--constraint"}


def pip_settings(listing: str) -> dict[str, list[str]]:
    """``pip config list``'s values by name, a variable's (``:env:.name``) over a file's."""
    settings, from_env = {}, set()
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.partition(".")
        if name in from_env:
            continue
        settings[name] = shlex.split(shlex.split(value)[0]) if value else []
        if section == ":env:":
            from_env.add(name)
    return settings


def uv_options(settings: dict[str, list[str]]) -> list[str]:
    options = ["--index-strategy", "unsafe-best-match"]
    for name, option in OPTIONS.items():
        for value in settings.get(name, []):
            options += [option, value]
    return options


if __name__ == "__main__":
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    )
    print(*uv_options(pip_settings(listing.stdout)), sep="\n")
