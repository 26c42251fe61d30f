"""The README.md model card uploaded with a merged folder, written from its ``merge_manifest.json``.

The card is a pure function of the manifest and the metadata the Hub reads (``card_metadata``: the base
model, the relation, the base's license, the task; no dates, no hosts, no environment), so re-uploading
the same folder produces the same bytes and sends nothing.

Our part of the card sits between two marker lines. A re-upload replaces only that part, so text a
user added to the README on the Hub (outside the markers) stays; a README.md without the markers
was not written by us and is never replaced (``readme_to_publish``).
"""

from __future__ import annotations

import json

from merge_pipeline.checkpoint_name import CheckpointName
from merge_pipeline.hub.card_metadata import CardMetadata

CARD = "README.md"
CARD_START = "<!-- merge_pipeline model card: replaced on every upload; text outside these two lines is kept -->"
CARD_END = "<!-- end of the merge_pipeline model card -->"


def _tag(writer: str) -> str:
    """A Hub tag for the stack that saved the checkpoint: verl, torchtitan, megatron-lm, hf-trainer."""
    return writer.removeprefix("the ").lower().replace(" ", "-")


def _model_index(name: str, evaluation: dict | None) -> list[str]:
    """The evaluation's metrics (the manifest's ``evaluation``, Dagster's ``evaluation`` asset) as the Hub's
    ``model-index``: its evaluation results, shown on the model page. Names are JSON strings, read by YAML as written."""
    if not evaluation or not evaluation.get("metrics"):
        return []
    lines = [
        "model-index:",
        f"- name: {json.dumps(name)}",
        "  results:",
        "  - task:",
        "      type: text-generation",
        "    dataset:",
        "      name: merge_pipeline evaluation",
        "      type: merge_pipeline-evaluation",
        "    metrics:",
    ]
    for metric, value in evaluation["metrics"].items():
        lines += [f"    - name: {json.dumps(metric)}", f"      type: {json.dumps(metric)}", f"      value: {value!r}"]
    return lines


def _front_matter(meta: CardMetadata | None, writer: str | None, index: list[str] = ()) -> list[str]:
    """The YAML the Hub reads: the model tree (base_model, base_model_relation), library, license, task, tags.
    Values from files we did not write (a base's license) are JSON strings, which YAML reads as written."""
    meta = meta or CardMetadata(None, None, "transformers", {}, None)
    fields = {
        "library_name": meta.library_name,
        "base_model": meta.base_model,
        "base_model_relation": meta.relation,
        **{key: json.dumps(value) for key, value in meta.license.items()},
        "pipeline_tag": meta.pipeline_tag,
    }
    return [
        "---",
        *(f"{key}: {value}" for key, value in fields.items() if value),
        "tags:",
        "- merge_pipeline",
        *([f"- {_tag(writer)}"] if writer else []),
        *index,
        "---",
    ]


def _fp8_rows(fp8: dict | None) -> list[tuple[str, str]]:
    """``--dtype fp8``: what is FP8 and what was kept in higher precision."""
    if not fp8:
        return []
    block = fp8["block"]
    kept = ", ".join(_code(name) for name in fp8["kept_modules"]) or "nothing"
    return [
        ("weights", f"{fp8['quantized_weights']} linear weights in FP8 (e4m3, one scale per {block}x{block} block)"),
        ("kept in bfloat16", f"{kept} (and every norm and bias)"),
    ]


def quantization_rows(quantization: dict | None) -> list[tuple[str, str]]:
    """``--quantize``: the scheme, how many weights it holds and what was kept (the card and the step report)."""
    if not quantization:
        return []
    kept = ", ".join(_code(name) for name in quantization["ignore"]) or "nothing"
    off_grid = len(quantization["off_grid"])
    # compressed-tensors names its format; another quant_method (gpt-oss's mxfp4) is named with what it writes
    method = f"quant_method {quantization['quant_method']}:" if "quant_method" in quantization else "compressed-tensors"
    return [
        (
            "weights",
            f"{quantization['quantized_weights']} linear weights in {quantization['scheme']}"
            f" ({method} {quantization['format']})",
        ),
        (
            "kept in bfloat16",
            f"{kept} (and every norm and bias)" + (f"; {off_grid} of them off the scheme's groups" if off_grid else ""),
        ),
        *([("not loaded by", quantization["not_loaded_by"])] if "not_loaded_by" in quantization else []),
    ]


def _smoke_lines(smoke: dict | None) -> list[str]:
    """The smoke test's result (Dagster's ``smoke_test`` setting): what a person reads first."""
    if not smoke:
        return []
    quoted = {k: json.dumps(smoke[k], ensure_ascii=False).replace("`", "'") for k in ("prompt", "text")}
    return [
        "## Smoke test",
        "",
        "Loaded with transformers on CPU after the merge; greedy decoding:",
        "",
        "```text",
        f"prompt:       {quoted['prompt']}",
        f"continuation: {quoted['text']}",
        "```",
        "",
        f"Mean next-token loss on a short fixed text: {smoke['loss']:.4f} (compare it between steps).",
        "",
    ]


def _origin_lines(source: dict, name: CheckpointName, tool: str) -> list[str]:
    """Where the weights come from: one checkpoint, or the weighted average of several (``average``)."""
    averaged = source["layout"].get("averaged_inputs")
    if not averaged:
        return [f"Merged from the {name.writer or 'training'} {source['backend']} checkpoint `{name}` by {tool}.", ""]
    accumulate = source["layout"].get("accumulate", "float32")
    return [
        f"The weighted average of {len(averaged)} checkpoints, accumulated in {accumulate}, by {tool}"
        " (config and tokenizer from the last):",
        "",
        "| averaged checkpoint | backend | weight |",
        "|---|---|---:|",
        *(f"| {_code(i['path'])} | {i['backend']} | {i['weight']:.6g} |" for i in averaged),
        "",
    ]


def _run_rows(source: dict, name: CheckpointName) -> list[tuple[str, str]]:
    """The run and step; an average's from its inputs (recorded with each since it was made: else not)."""
    averaged = source["layout"].get("averaged_inputs")
    if not averaged:
        return [("run", _code(name.run)), ("step", "not recorded" if name.step is None else str(name.step))]
    names = [CheckpointName(**one["checkpoint"]) for one in averaged if "checkpoint" in one]
    runs = ", ".join(f"`{run}`" for run in dict.fromkeys(n.run for n in names if n.run))
    steps = ", ".join(str(n.step) for n in names if n.step is not None)
    return [("run", runs or "not recorded"), ("steps", steps or "not recorded")]


def render_card(
    manifest: dict,
    repo_id: str,
    *,
    replaces_readme: bool = False,
    smoke: dict | None = None,
    hub: CardMetadata | None = None,
) -> str:
    """``hub``: what the Hub reads in the front matter (``card_metadata.card_metadata``); without it, library and tags."""
    source, decisions, options = manifest["source"], manifest["decisions"], manifest["options"]
    name = CheckpointName.from_manifest(source)
    tool = f"{manifest['tool']['name']} {manifest['tool']['version']}"
    dtype = decisions["config_dtype"] + (
        "" if options.get("dtype") in (None, "auto") else f" (requested: {options['dtype']})"
    )
    rows = [
        *_run_rows(source, name),
        ("role", _code(name.role)),
        ("source checkpoint", _code(source["role_dir"])),
        ("backend", source["backend"]),
        ("world size", str(source["layout"].get("world_size", "not recorded"))),
        ("dtype", dtype),
        *_fp8_rows(decisions.get("fp8")),
        *quantization_rows(decisions.get("quantization")),
        ("parameters", f"{manifest['parameters']:,}"),
        ("tool", tool),
    ]
    lines = [
        *_front_matter(hub, name.writer, _model_index(repo_id.split("/")[-1], manifest.get("evaluation"))),
        CARD_START,
        "",
        f"# {repo_id.split('/')[-1]}",
        "",
        *_origin_lines(source, name, tool),
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in rows),
        "",
        *_smoke_lines(smoke),
        "## Files",
        "",
        "Sizes and sha256 recorded in `merge_manifest.json` when the folder was merged; the upload is "
        "checked against them.",
    ]
    if replaces_readme:
        lines += ["", f"This card replaces the `{CARD}` the checkpoint carried; the sum below is that file's."]
    lines += ["", "| file | bytes | sha256 |", "|---|---:|---|"]
    lines += [
        f"| `{path}` | {entry['size']:,} | `{entry['sha256']}` |" for path, entry in sorted(manifest["files"].items())
    ]
    lines += ["", CARD_END]
    return "\n".join(lines) + "\n"


def readme_to_publish(card: str, on_hub: bytes | None) -> str | None:
    """The README.md to publish given the one the Hub holds: the card where there is none, the
    README with our marked part replaced where it carries our markers, and None (keep it as it is)
    for a README someone else wrote."""
    if on_hub is None:
        return card
    try:
        text = on_hub.decode()
    except UnicodeDecodeError:
        return None
    start, end = text.find(CARD_START), text.find(CARD_END)
    if start < 0 or end < start:
        return None
    ours = card[card.index(CARD_START) : card.index(CARD_END) + len(CARD_END)]
    return text[:start] + ours + text[end + len(CARD_END) :]


def _code(value: str | None) -> str:
    return "not recorded" if value is None else f"`{value}`"
