"""torchtitan model names to HF names, as each family's ``state_dict_adapter.to_hf`` (torchtitan 0.3.0).

The family is chosen from the HF config's ``model_type``; its record (``merge_pipeline/families.py``,
``Family.torchtitan``) holds the names its adapter maps. What each ``to_hf`` does, streamed as byte ranges:

- llama3 (``llama``): q/k rows permuted back to HF's rotary layout (each HF row is one stored row).
- qwen3 / qwen3_moe, deepseek_v3, gpt_oss: names only; qwen3 and gpt_oss keep HF's rotary layout.
- MoE (qwen3, deepseek_v3): grouped experts ``w1_EFD`` / ``w3_EFD`` / ``w2_EDF`` (experts first) split
  into ``mlp.experts.<e>.gate/up/down_proj`` (``_split_experts_weights``: expert ``e`` is index ``e``).
- deepseek_v3: MLA names, shared experts, ``expert_bias_E`` as ``mlp.gate.e_score_correction_bias``,
  MTP layers ``mtp_layers.<k>`` as HF layer ``num_hidden_layers + k``.
- Tied embeddings (``tie_word_embeddings``): ``lm_head`` is dropped, as ``to_hf`` does.

The older torchtitan Llama names (``attention.wq``, ``output``) keep working. Entries an adapter drops
(Qwen3's router ``expert_bias_E``) are dropped too; a name no adapter maps is one error naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

from merge_pipeline import families
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.output_specs import OutputSpec, Piece, whole

TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
HEADS = ("lm_head.weight", "output.weight")  # torchtitan 0.3 and older
_LAYER = re.compile(r"(layers|mtp_layers)\.(\d+)\.(.+)")


def torchtitan_outputs(
    sizes: dict[str, tuple[int, ...]], config: dict, config_path: Path, metadata_path: Path
) -> list[OutputSpec]:
    """The HF tensors as the family's torchtitan ``to_hf`` makes them, from the stored tensors' sizes."""
    model_type = config.get("model_type")
    family = families.by_model_type(model_type)
    if family is None or family.torchtitan is None:
        known = sorted(f.model_type for f in families.FAMILIES.values() if f.torchtitan)
        raise MergeError(
            config_path,
            f"model_type {model_type!r}: not a torchtitan family this reader maps "
            f"({', '.join(known)}); pass --hf_model_path with the model's own HF config",
        )
    names = family.torchtitan
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    layers = config.get("num_hidden_layers")
    if not all(isinstance(n, int) and n >= 1 for n in (heads, kv_heads, layers)):
        raise MergeError(
            config_path,
            f"num_attention_heads {heads!r} / num_key_value_heads {kv_heads!r} / num_hidden_layers {layers!r}: not counts",
        )
    tied = bool(config.get("tie_word_embeddings"))
    specs = []
    for key, size in sizes.items():
        if key in TOP:
            specs.append(whole(TOP[key], key, size[0]))
            continue
        if key in HEADS:
            if not tied:  # to_hf drops the head of a tied model
                specs.append(whole("lm_head.weight", key, size[0]))
            continue
        match = _LAYER.fullmatch(key)
        inner = match[3] if match else None
        if inner not in names.layer and inner not in names.grouped_experts:
            raise MergeError(
                metadata_path, f"{key}: not a torchtitan {names.model} weight this reader maps to HF names"
            )
        layer = int(match[2]) + (layers if match[1] == "mtp_layers" else 0)
        prefix = f"model.layers.{layer}."
        if inner in names.grouped_experts:  # experts on dimension 0, one HF tensor each
            hf = prefix + names.grouped_experts[inner]
            specs.extend(whole(hf.format(e), key, size[1], (e,)) for e in range(size[0]))
            continue
        if names.layer[inner] is None:
            continue
        name = prefix + names.layer[inner]
        if names.rotary_permuted and inner.endswith(("wq.weight", "wk.weight")):
            groups = heads if inner.endswith("wq.weight") else kv_heads
            if size[0] % (2 * groups):
                raise MergeError(metadata_path, f"{key}: {size[0]} rows do not split into {groups} rotary heads")
            specs.append(OutputSpec(name, tuple(Piece(key, (), (r, r + 1)) for r in _rotary_rows(size[0], groups))))
        else:
            specs.append(whole(name, key, size[0]))
    return specs


def _rotary_rows(rows: int, heads: int) -> list[int]:
    """For each HF row, the torchtitan row it comes from. torchtitan's ``_permute`` views a head's rows
    as (half, 2) and transposes them to (2, half): HF row ``b * half + a`` is stored row ``2 * a + b``."""
    per_head = rows // heads
    half = per_head // 2
    return [head * per_head + 2 * (row % half) + row // half for head in range(heads) for row in range(per_head)]
