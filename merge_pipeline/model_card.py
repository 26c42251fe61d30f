"""The README.md model card uploaded with a merged folder, written from its ``merge_manifest.json``.

The card is a pure function of the manifest (no dates, no hosts, no environment), so re-uploading
the same folder produces the same bytes and sends nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

CARD = "README.md"
_STEP = re.compile(r"global_step_(\d+)")


@dataclass(frozen=True)
class CheckpointName:
    """Where a verl checkpoint sits: ``<run>/global_step_<step>/<role>``."""

    run: str | None
    step: int | None
    role: str

    @classmethod
    def from_role_dir(cls, role_dir: str | PurePath, role: str | None = None) -> CheckpointName:
        path = PurePath(role_dir)
        if _STEP.fullmatch(path.name):  # the SFT trainer's step folder is the checkpoint itself
            path = path / (role or "model")
        match = _STEP.fullmatch(path.parent.name)
        if match is None:  # not a verl layout: keep what is known
            return cls(None, None, role or path.name)
        return cls(path.parent.parent.name or None, int(match.group(1)), role or path.name)

    def __str__(self) -> str:
        if self.step is None:
            return self.role
        return f"{self.run}/global_step_{self.step}/{self.role}" if self.run else f"global_step_{self.step}/{self.role}"


def render_card(manifest: dict, repo_id: str, *, replaces_readme: bool = False) -> str:
    source, decisions, options = manifest["source"], manifest["decisions"], manifest["options"]
    name = CheckpointName.from_role_dir(source["role_dir"], source.get("role"))
    tool = f"{manifest['tool']['name']} {manifest['tool']['version']}"
    dtype = decisions["config_dtype"] + ("" if options.get("dtype") in (None, "auto") else f" (requested: {options['dtype']})")
    rows = [
        ("run", _code(name.run)),
        ("step", "not recorded" if name.step is None else str(name.step)),
        ("role", _code(name.role)),
        ("source checkpoint", _code(source["role_dir"])),
        ("backend", source["backend"]),
        ("world size", str(source["layout"].get("world_size", "not recorded"))),
        ("dtype", dtype),
        ("parameters", f"{manifest['parameters']:,}"),
        ("tool", tool),
    ]
    lines = [
        "---",
        "library_name: transformers",
        "tags:",
        "- merge_pipeline",
        "- verl",
        "---",
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        f"Merged from the verl {source['backend']} checkpoint `{name}` by {tool}.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in rows),
        "",
        "## Files",
        "",
        "Sizes and sha256 recorded in `merge_manifest.json` when the folder was merged; the upload is "
        "checked against them.",
    ]
    if replaces_readme:
        lines += ["", f"This card replaces the `{CARD}` the checkpoint carried; the sum below is that file's."]
    lines += ["", "| file | bytes | sha256 |", "|---|---:|---|"]
    lines += [f"| `{path}` | {entry['size']:,} | `{entry['sha256']}` |" for path, entry in sorted(manifest["files"].items())]
    return "\n".join(lines) + "\n"


def _code(value: str | None) -> str:
    return "not recorded" if value is None else f"`{value}`"
