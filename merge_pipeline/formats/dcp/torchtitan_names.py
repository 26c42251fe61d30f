"""torchtitan model names to HF names, as each family's ``state_dict_adapter.to_hf`` (torchtitan 0.3.0).

The family is chosen from the HF config's ``model_type``; its record (``merge_pipeline/families.py``,
``Family.torchtitan``) holds the names its adapter maps. What each ``to_hf`` does, streamed as byte ranges:

- llama3 (``llama``): q/k rows permuted back to HF's rotary layout (each HF row is one stored row).
- qwen3 / qwen3_moe, deepseek_v3: names only; qwen3 keeps HF's rotary layout.
- gpt_oss: names (sinks, biases, router) and its grouped experts, which its ``to_hf`` drops (its map
  names ``mlp1_weight``, the model saves ``mlp1_weight_EGD``), as transformers' GptOssForCausalLM loads
  them: ``mlp1_weight_EGD`` [E, 2F, D] and ``mlp2_weight_EDF`` [E, D, F] with each expert's matrix
  transposed into ``gate_up_proj`` [E, D, 2F] and ``down_proj`` [E, F, D] (its rows already interleave
  gate and up, as HF's columns do); the biases as stored.
- MoE (qwen3, deepseek_v3, kimi_k2_7, qwen3_5): grouped experts ``w1_EFD`` / ``w3_EFD`` / ``w2_EDF`` (experts
  first) split into ``mlp.experts.<e>.gate/up/down_proj`` (``_split_experts_weights``: expert ``e`` is index ``e``).
- deepseek_v3: MLA names, shared experts, ``expert_bias_E`` as ``mlp.gate.e_score_correction_bias``,
  MTP layers ``mtp_layers.<k>`` as HF layer ``num_hidden_layers + k``.
- qwen3_5: under ``model.language_model.``; the linear-attention q/k/v projections and convolutions
  concatenated (rows); the vision tower's q/k/v concatenated into ``qkv``; its patch embedding
  reshaped into HF's Conv3d weight (sizes from ``vision_config``). Its ``to_hf`` transposes the grouped
  experts into ``mlp.experts.gate_up_proj`` [E, D, 2F] / ``down_proj`` [E, F, D], which transformers 5's
  Qwen3_5Moe does not load ([E, 2F, D] / [E, D, F]): they are split per expert as above, which it loads.
- kimi_k2_7 (Kimi-K2.5): deepseek_v3's names under ``language_model.`` when a vision tower is saved, the
  vision tower's names, q/k/v concatenated into ``wqkv``, the patch embedding reshaped into a Conv2d weight.
- Tied embeddings (``tie_word_embeddings``): ``lm_head`` is dropped, as ``to_hf`` does.

The older torchtitan Llama names (``attention.wq``, ``output``) keep working. Entries an adapter drops
(Qwen3's router ``expert_bias_E``) are dropped too; a name no adapter maps is one error naming it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from merge_pipeline import families
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.conversions import (
    Concatenate,
    GroupedExperts,
    Operation,
    PerExpert,
    PermuteForRope,
    Rename,
    Reshape,
    Sizes,
    Stored,
    named,
)
from merge_pipeline.formats.output_specs import OutputSpec, whole
from merge_pipeline.hf.config import text_section

TOP = {"tok_embeddings.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}
HEADS = ("lm_head.weight", "output.weight")  # torchtitan 0.3 and older
VISION = "vision_encoder."
_LAYER = re.compile(r"(layers|mtp_layers)\.(\d+)\.(.+)")


def torchtitan_outputs(
    sizes: dict[str, tuple[int, ...]],
    config: dict,
    config_path: Path,
    metadata_path: Path,
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
    text = text_section(config)  # vision-language configs keep the language model's sizes there
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or heads
    layers = text.get("num_hidden_layers")
    if not all(isinstance(n, int) and n >= 1 for n in (heads, kv_heads, layers)):
        raise MergeError(
            config_path,
            f"num_attention_heads {heads!r} / num_key_value_heads {kv_heads!r} / num_hidden_layers {layers!r}: not counts",
        )
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings")))
    nested = names.nested_with_vision if any(k.startswith(VISION) for k in sizes) else ""
    fused = _Fused(names, metadata_path)
    operations = _layer_operations(names)
    model = Sizes(config_path, metadata_path, heads, kv_heads)
    specs = []
    for key, size in sizes.items():
        if key in TOP:
            specs.append(whole(nested + names.text_prefix + TOP[key], key, size[0]))
            continue
        if key in HEADS:
            if not tied:  # to_hf drops the head of a tied model
                specs.append(whole(nested + "lm_head.weight", key, size[0]))
            continue
        if key.startswith(VISION):
            specs.extend(_vision(key, size, names, fused, config, config_path, metadata_path))
            continue
        match = _LAYER.fullmatch(key)
        inner = match[3] if match else None
        if match is None or inner not in operations and inner not in fused.parts:
            raise MergeError(
                metadata_path,
                f"{key}: not a torchtitan {names.model} weight this reader maps to HF names",
            )
        layer = int(match[2]) + (layers if match[1] == "mtp_layers" else 0)
        prefix = f"{nested}{names.text_prefix}layers.{layer}."
        if fused.collect(Stored(key, size), inner, prefix) or operations[inner] is None:
            continue
        specs.extend(named(operations[inner], prefix.__add__).outputs(Stored(key, size), model))
    return specs + fused.outputs()


def _layer_operations(names: families.Torchtitan) -> dict[str, Operation | None]:
    """The operation of each torchtitan name inside ``layers.<i>.``, from the family's record; None: to_hf drops it."""
    operations: dict[str, Operation | None] = {
        inner: None if hf is None else Rename(hf) for inner, hf in names.layer.items()
    }
    if names.rotary_permuted:
        rotary = {inner: hf for inner, hf in names.layer.items() if hf and inner.endswith(("wq.weight", "wk.weight"))}
        operations.update({inner: PermuteForRope(hf, kv=inner.endswith("wk.weight")) for inner, hf in rotary.items()})
    operations.update({inner: GroupedExperts(hf) for inner, hf in names.transposed_experts.items()})  # [E, out, in]
    operations.update({inner: PerExpert(hf) for inner, hf in names.grouped_experts.items()})  # [E, ...]
    return operations


class _Fused:
    """HF tensors that ``to_hf`` concatenates from several stored tensors (rows, in order): collected part by part."""

    def __init__(self, names: families.Torchtitan, metadata_path: Path):
        self.metadata_path = metadata_path
        # torchtitan name -> (HF name, its place among the parts, the number of parts)
        self.parts = {
            part: (hf, i, len(parts))
            for table in (names.fused_layer, names.fused_vision)
            for hf, parts in table.items()
            for i, part in enumerate(parts)
        }
        self.found: dict[str, tuple[int, dict[int, Stored]]] = {}  # HF name -> (parts, parts found)

    def collect(self, stored: Stored, name: str, prefix: str = "", number: str = "") -> bool:
        """Note ``stored`` (torchtitan ``name``) as a part of the HF tensor ``prefix + hf.format(number)``."""
        if name not in self.parts:
            return False
        hf, i, count = self.parts[name]
        self.found.setdefault(prefix + hf.format(number), (count, {}))[1][i] = stored
        return True

    def outputs(self) -> list[OutputSpec]:
        specs = []
        for name, (count, found) in self.found.items():
            if len(found) != count:
                present = ", ".join(part.key for part in found.values())
                raise MergeError(
                    self.metadata_path,
                    f"{present}: the other parts of {name} are missing",
                )
            specs.append(Concatenate(name).of([found[i] for i in range(count)]))
        return specs


def _vision(
    key: str,
    size: tuple[int, ...],
    names: families.Torchtitan,
    fused: _Fused,
    config: dict,
    config_path: Path,
    metadata_path: Path,
) -> list[OutputSpec]:
    """One vision-tower tensor: renamed, a part of a fused q/k/v, or the patch embedding reshaped."""
    if names.patch_embed is not None and key == names.patch_embed[0]:
        return [_patch_embedding(key, size, names.patch_embed, config, config_path, metadata_path)]
    number = re.search(r"\d+", key)
    abstract = re.sub(r"\d+", "{}", key, count=1)
    if abstract in names.vision:
        return [whole(names.vision[abstract].format(number[0] if number else ""), key, size[0])]
    if key in names.vision:
        return [whole(names.vision[key], key, size[0])]
    if fused.collect(Stored(key, size), abstract, number=number[0] if number else ""):
        return []
    raise MergeError(
        metadata_path,
        f"{key}: not a torchtitan {names.model} vision weight this reader maps to HF names",
    )


def _patch_embedding(
    key: str,
    size: tuple[int, ...],
    patch_embed: tuple[str, str, tuple[str, ...]],
    config: dict,
    config_path: Path,
    metadata_path: Path,
) -> OutputSpec:
    """torchtitan's Linear [out, C * kernel] as HF's Conv weight [out, C, *kernel]: the same bytes."""
    _, hf, kernel_keys = patch_embed
    vision = config.get("vision_config") or {}
    kernel = tuple(vision.get(k) for k in kernel_keys)
    if not all(isinstance(n, int) and n >= 1 for n in kernel):
        raise MergeError(
            config_path,
            f"vision_config {', '.join(kernel_keys)} = {kernel}: the patch embedding's kernel size is needed to "
            f"reshape {key}; pass --hf_model_path with the model's own HF config",
        )
    if len(size) != 2 or size[1] % math.prod(kernel):
        raise MergeError(
            metadata_path,
            f"{key}: shape {size} is not [out, channels x {' x '.join(map(str, kernel))}]",
        )
    return Reshape(hf, (size[0], size[1] // math.prod(kernel), *kernel)).of((Stored(key, size).piece(),))
