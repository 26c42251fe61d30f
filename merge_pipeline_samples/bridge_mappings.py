"""Megatron-Bridge's own name mappings, as plain JSON: run with the bridge venv's python.

    .venv-bridge/bin/python merge_pipeline_samples/bridge_mappings.py merge_pipeline/bridge_mappings.json

Walks every architecture Megatron-Bridge registers (``MegatronModelBridge.register_bridge`` puts each
bridge class in ``get_model_bridge``'s dispatch table), asks its bridge for ``mapping_registry()`` and
writes, per HF architecture: the bridge class, its ``model_type``, and each parameter mapping as its kind
(the mapping's class and the Megatron-Bridge classes it derives from), its Megatron name pattern, its HF
name(s) and its plain parameters (``permute_dims``, ``transpose_on_export``, ...). Patterns keep the
bridge's wildcards: ``*`` a number (layer, expert), ``**`` any path. The output is committed
(``merge_pipeline/bridge_mappings.json``) and the reader reads it: Megatron-Bridge is never imported at
merge time. Rerun it when the bridge is upgraded; ``merge_pipeline_tests/formats/megatron/test_bridge_mappings.py``
checks the committed file is what this produces.

A few bridges build their registry from the HF config (how many layers are dense, which have MTP): those are
asked with the default config of the family's transformers config class (``AutoConfig.for_model``), and the
architecture's entry says ``"from_default_config": true``. A mapping of a parameter megatron-core saves in parts
(Gated DeltaNet's in_proj and conv1d: ``<name>.query``, ``.key``, ...; Mamba's: ``.z``, ``.x``, ...) also says, under ``"parts"``, which parts
make up each of its HF tensors (by role) and whether they alternate per key head: found by running the mapping's own
``megatron_to_hf`` (one process, TP=1) on a tensor whose rows are labelled by the part they come from. Gemma 4's bridges pick a dense model's registry or the
MoE one by the config: both are written, the dense one as ``"dense_mappings"``. A bridge whose registry cannot be built that way is
written with its error (``"error"``), so that it is accounted for, not dropped.

Megatron-Bridge imports TransformerEngine unconditionally in two modules: the venv's CPU stand-in for it
(``merge_pipeline_samples/te_stand_in/``, installed by ``scripts/setup_bridge.sh``) answers.
"""

from __future__ import annotations

import json
import logging
import sys
import types
import warnings
from pathlib import Path

# Run as a script, its own folder comes first on the path, where megatron.py would hide megatron-core.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])
from merge_pipeline_samples.megatron_bridge_save import _import_bridge  # noqa: E402  (after its path)

_BRIDGE_MODULE = "megatron.bridge."
# megatron-core 0.18's GatedDeltaNet and MambaMixer sharded_state_dict save in_proj and conv1d in parts, which at TP=1
# make up the module's tensor in this order: their names and row counts at the probe's sizes (Gated DeltaNet: key
# heads of 2 rows, two value heads of 3 rows per key head; Mamba: 2 heads of 3 channels, one group of state 2).
_PROBE = dict(
    hidden_size=1,
    linear_num_key_heads=2,
    linear_key_head_dim=2,
    linear_num_value_heads=4,
    linear_value_head_dim=3,
    mamba_num_heads=2,
    mamba_head_dim=3,
    mamba_num_groups=1,
    mamba_state_dim=2,
)
_KEYS, _VALUES = 2 * 2, 4 * 3
_GDN_IN_PROJ = (("query", _KEYS), ("key", _KEYS), ("value", _VALUES), ("z", _VALUES), ("beta", 4), ("alpha", 4))
_MAMBA_IN_PROJ = (("z", 6), ("x", 6), ("B", 2), ("C", 2), ("dt", 2))
_SAVED_IN_PARTS = {
    "GDNLinearMapping": _GDN_IN_PROJ,
    "GDNLinearMappingSeparate": _GDN_IN_PROJ,
    "GDNConv1dMapping": _GDN_IN_PROJ[:3],
    "MambaInProjMapping": _MAMBA_IN_PROJ,
    "MambaConv1dMapping": _MAMBA_IN_PROJ[1:4],
}


def _plain(value):
    """A mapping parameter as JSON, or None when it is not plain data (process groups, caches)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (str, int, float, bool)) for v in value):
        return list(value)
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(sorted(value.items()))
    return None


def _mapping(mapping) -> dict:
    # The mapping's class, then the Megatron-Bridge classes it derives from (a family's own kind names
    # the standard one it specialises); MegatronParamMapping, the base of all, is left out.
    kinds = [
        c.__name__
        for c in type(mapping).__mro__
        if c.__module__.startswith(_BRIDGE_MODULE) and c.__name__ != "MegatronParamMapping"
    ]
    params = {}
    for name, value in sorted(vars(mapping).items()):
        if name.startswith("_") or name in ("megatron_param", "hf_param") or name.endswith("_group"):
            continue
        plain = _plain(value)
        if plain is not None or value is None:
            params[name] = plain
    entry = {"kind": kinds, "megatron": mapping.megatron_param, "hf": _plain(mapping.hf_param), "params": params}
    if type(mapping).__name__ in _SAVED_IN_PARTS:
        entry["parts"] = _parts(mapping, _SAVED_IN_PARTS[type(mapping).__name__])
    return entry


def _parts(mapping, saved: tuple[tuple[str, int], ...]) -> dict:
    """Each HF tensor (by role) of a parameter saved in parts, as the bridge's ``megatron_to_hf`` builds it from the
    parts' rows: ``{"parts": [names in order], "per_key_head": bool}`` (every part's rows of key head 0, then of key
    head 1, ...; else each part whole in turn). A layout neither describes fails the generator."""
    import torch

    labels = [(name, row) for name, rows in saved for row in range(rows)]
    weight = torch.arange(len(labels), dtype=torch.float64)
    if mapping.megatron_param.endswith("weight"):  # a linear's [rows, hidden], a convolution's [channels, 1, kernel]
        weight = weight[:, None, None] if "conv1d" in mapping.megatron_param else weight[:, None]
    module = type("ColumnParallelLinear", (torch.nn.Module,), {})()  # the TP split the bridge looks up: none at TP=1
    module.config = types.SimpleNamespace(**_PROBE)
    resolved = mapping.resolve(("0",) * mapping.megatron_param.count("*"))
    roles = resolved.hf_param if isinstance(resolved.hf_param, dict) else {"": resolved.hf_param}
    built = resolved.megatron_to_hf(weight, module)
    sizes = dict(saved)
    out = {}
    for role, name in roles.items():
        got = [labels[int(i)] for i in built[name].flatten()]  # one column: each row its label
        parts = list(dict.fromkeys(part for part, _ in got))
        for per_key_head, groups in ((False, 1), (True, _PROBE["linear_num_key_heads"])):
            blocks = [
                (part, row)
                for g in range(groups)
                for part in parts
                for row in range(g * sizes[part] // groups, (g + 1) * sizes[part] // groups)
            ]
            if got == blocks:
                out[role] = {"parts": parts, "per_key_head": per_key_head}
                break
        else:
            raise ValueError(f"{mapping.megatron_param} -> {name}: rows {got} are not parts in turn or per key head")
    return out


# Bridges whose registry reads the HF config when it has one and otherwise names another form of checkpoint: ERNIE
# 4.5-VL's names its remote-code (flat config) checkpoints' vision tower vision_model.**, transformers' own config
# model.vision_model.** (the tiny models are built from transformers' config).
_READS_CONFIG = {"Ernie4_5_VLMoeForConditionalGeneration"}


def _registry(source, factory) -> tuple[object, list, bool]:
    bridge = factory(source)
    try:
        if (source if isinstance(source, str) else source.__name__) in _READS_CONFIG:
            raise AttributeError("asked with the HF config")
        return bridge, bridge.mapping_registry().mappings, False
    except AttributeError:  # its registry reads the HF config
        import transformers

        model_type = getattr(bridge, "MODEL_TYPE", None) or source.config_class.model_type
        config = transformers.AutoConfig.for_model(model_type)
        bridge = factory(source, hf_config=types.SimpleNamespace(config=config))
        return bridge, bridge.mapping_registry().mappings, True


def _dense_registry(bridge) -> list | None:
    """Gemma 4's bridges keep a dense model's registry beside the MoE one and pick by the HF config
    (``enable_moe_block``; ``provider_bridge`` sets ``_is_dense``): the dense one, asked the same way."""
    if not hasattr(bridge, "_dense_mapping_registry"):
        return None
    bridge._is_dense = True
    return bridge.mapping_registry().mappings


def bridge_mappings() -> dict:
    _import_bridge()
    import megatron.bridge.models  # noqa: F401  (registers every bridge)
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    out = {}
    for source, factory in get_model_bridge._exact_types.items():
        architecture = source if isinstance(source, str) else source.__name__
        bridge_class = type(factory(source))
        entry = {"bridge": bridge_class.__name__, "model_type": getattr(bridge_class, "MODEL_TYPE", None)}
        try:
            bridge, mappings, from_config = _registry(source, factory)
            dense = _dense_registry(bridge)
        except Exception as exc:  # noqa: BLE001  (recorded: the architecture stays accounted for)
            entry["error"] = f"{type(exc).__name__}: {exc}"
        else:
            entry["from_default_config"] = from_config
            entry["mappings"] = [_mapping(m) for m in mappings]
            if dense is not None:
                entry["dense_mappings"] = [_mapping(m) for m in dense]
        out[architecture] = entry
    return dict(sorted(out.items()))


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from importlib.metadata import version

    data = {
        "generator": "merge_pipeline_samples/bridge_mappings.py",
        "megatron_bridge": version("megatron-bridge"),
        "megatron_core": version("megatron-core"),
        "transformers": version("transformers"),
        "architectures": bridge_mappings(),
    }
    Path(argv[0]).write_text(_dump(data))


def _dump(data: dict) -> str:
    """JSON with one line per mapping: a bridge upgrade reads as a short diff."""
    lines = ["{"]
    lines += [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in data.items() if k != "architectures"]
    lines.append(' "architectures": {')
    for i, (architecture, entry) in enumerate(data["architectures"].items()):
        lists = ("mappings", "dense_mappings")
        fields = [f"   {json.dumps(k)}: {json.dumps(v)}" for k, v in entry.items() if k not in lists]
        for name in (name for name in lists if name in entry):
            rows = ",\n".join(f"    {json.dumps(m)}" for m in entry[name])
            fields.append(f"   {json.dumps(name)}: [\n{rows}\n   ]")
        comma = "," if i < len(data["architectures"]) - 1 else ""
        lines.append(f"  {json.dumps(architecture)}: {{\n" + ",\n".join(fields) + f"\n  }}{comma}")
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(sys.argv[1:])
