"""The model card metadata the Hub reads to place a merged folder in its base model's tree.

``base_model`` is the first Hub id (``org/name``) among, in order:

1. ``--hf_model_path`` (the manifest's ``options.hf_model_path``): the value itself when it is a Hub id and
   no folder here, the id a Hub cache folder is named by (``.../models--org--name/snapshots/<rev>``), or the
   ``_name_or_path`` of its ``config.json``;
2. the ``_name_or_path`` of the merged folder's ``config.json``: the model path the trainer loaded, which
   transformers recorded in the config the checkpoint carries.

A value is taken only if it looks like ``org/name`` and names nothing on this machine: a local path never
reaches the Hub. No id found: no ``base_model`` and no relation (the Hub needs both).

``base_model_relation`` comes from the manifest alone (``relation``): ``merge`` for an average, ``adapter``
(with ``library_name: peft``) for LoRA written unfolded (``lora_adapter/``, or an adapter folder alone),
else ``finetune``, quantized or not: the Hub's ``quantized`` means the base's own weights in fewer bits, and
a merge's are a training step's.

The base's license (``license``, and ``license_name`` / ``license_link`` with ``license: other``) is read
from the front matter of the ``README.md`` in the ``--hf_model_path`` folder; ``pipeline_tag`` from the
architecture in ``config.json``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from merge_pipeline.errors import MergeError
from merge_pipeline.files.inputs import read_capped
from merge_pipeline.files.json_files import read_json_object

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
HUB_CACHE_FOLDER = re.compile(r"(?:^|/)models--([\w.-]+?)--([\w.-]+)/snapshots/[^/]+/?$")
LICENSE_KEYS = ("license", "license_name", "license_link")
MAX_README_BYTES = 1 << 20  # a model card; a larger README is read for no license
# the architecture's class name ends -> the Hub's task; others get no pipeline_tag
PIPELINE_TAGS = {
    "ForCausalLM": "text-generation",
    "LMHeadModel": "text-generation",
    "ForTokenClassification": "token-classification",  # a value model (critic, reward)
    "ForSequenceClassification": "text-classification",
}


@dataclass(frozen=True)
class CardMetadata:
    base_model: str | None
    relation: str | None  # None without a base_model
    library_name: str
    license: dict[str, str]  # LICENSE_KEYS found in the base's README
    pipeline_tag: str | None


def card_metadata(folder: Path, manifest: dict) -> CardMetadata:
    """The metadata for the card of ``folder`` (a merged folder here) and its manifest."""
    base_dir = _base_dir(manifest)
    config = _json(folder / "config.json") or (_json(base_dir / "config.json") if base_dir else {})
    base = next(filter(None, (*_base_candidates(manifest, base_dir), hub_id(config.get("_name_or_path")))), None)
    kind = relation(manifest)
    return CardMetadata(
        base_model=base,
        relation=kind if base else None,
        library_name="peft" if kind == "adapter" else "transformers",
        license=_license(base_dir) if base_dir else {},
        pipeline_tag=pipeline_tag(config),
    )


def relation(manifest: dict) -> str:
    """How the folder relates to its base model, from what the manifest records (see the module's doc)."""
    decisions = manifest["decisions"]
    if manifest["source"]["layout"].get("averaged_inputs"):
        return "merge"
    lora = decisions.get("lora")
    if lora and not lora["merged"]:
        return "adapter"
    return "finetune"


def hub_id(value: object) -> str | None:
    """``value`` when it is a Hub model id (``org/name``) and not a path on this machine, else None."""
    if not isinstance(value, str) or not HUB_ID.fullmatch(value) or "--" in value or ".." in value:
        return None
    return None if value.endswith(".git") or Path(value).exists() else value


def pipeline_tag(config: dict) -> str | None:
    architectures = config.get("architectures")
    name = architectures[0] if isinstance(architectures, list) and architectures else None
    return next((tag for end, tag in PIPELINE_TAGS.items() if isinstance(name, str) and name.endswith(end)), None)


def _base_dir(manifest: dict) -> Path | None:
    given = manifest["options"].get("hf_model_path")
    return Path(given) if given and Path(given).is_dir() else None


def _base_candidates(manifest: dict, base_dir: Path | None) -> list[str | None]:
    given = manifest["options"].get("hf_model_path")
    if not given:
        return []
    if base_dir is None:
        return [hub_id(given)]
    cached = HUB_CACHE_FOLDER.search(base_dir.resolve().as_posix())
    return [
        hub_id(f"{cached[1]}/{cached[2]}") if cached else None,
        hub_id(_json(base_dir / "config.json").get("_name_or_path")),
    ]


def _license(base_dir: Path) -> dict[str, str]:
    import yaml
    from huggingface_hub import ModelCard  # the Hub client's own reading of a card's front matter

    try:
        text = read_capped(base_dir / "README.md", MAX_README_BYTES, "too large").decode()
        front = ModelCard(text, ignore_metadata_errors=True).data.to_dict() if text.startswith("---") else {}
    except (MergeError, OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):  # unreadable: no license named
        return {}
    return {k: str(front[k]) for k in LICENSE_KEYS if isinstance(front.get(k), str) and front[k]}


def _json(path: Path) -> dict:
    try:
        return read_json_object(path)
    except (MergeError, OSError):  # none, or not a config: nothing read from it
        return {}
