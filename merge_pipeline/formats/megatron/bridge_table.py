"""Megatron-Bridge's name mappings, read from ``merge_pipeline/bridge_mappings.json``.

That file is generated from the installed bridge's own ``mapping_registry()`` of each architecture by
``merge_pipeline_samples/bridge_mappings.py`` (never imported here: Megatron-Bridge is not a dependency of
the reader). Each mapping's kind is translated into an operation of the reader's conversion vocabulary
(``formats/conversions.py``): ``copy`` (the tensor as stored, whatever its tensor-parallel split),
``qkv`` (fused rows [q heads | k | v] per KV group, split in three), ``gate_up`` (a gated fc1, gate rows
then up rows), ``unsqueeze`` (the tensor as stored, under a leading dimension of 1), ``vision_qkv`` (a vision
tower's per-head q, k, v rows regrouped as HF's fused [q; k; v]), ``grouped_experts``
(every expert of a layer in one HF tensor, gpt-oss's transposed layout), ``stacked_experts`` (every expert of a
layer in one HF tensor, each matrix as stored: Gemma 4's fused experts), ``qkv_own_kv`` (``qkv`` less the K and V a
Gemma 4 layer does not hold: a KV-shared layer's, V where keys are values), ``pooled_rows`` (a tensor per expert pool
as a row of one HF tensor: ERNIE 4.5-VL's expert-score bias; its vision pool's experts are numbered after the text
pool's in HF, ``expert_pool_offset``), ``transpose`` (a copy whose 2-D tensor the bridge permutes with
``permute_dims`` (1, 0): Gemma 3's projector), ``add_one`` (a zero-centred norm weight plus one), ``saved_parts``
(Mamba's and Gated DeltaNet's in_proj and conv1d, saved by megatron-core as named parts: each HF tensor the parts the
generator found for its role, ``"parts"`` in the file, in order or per key head). Kinds with no operation here
(chunked convolutions, ...) translate to
None: an architecture that needs one is not merged. A bridge that keeps a dense model's registry beside its default
(Gemma 4's, chosen by ``enable_moe_block``) has it recorded as ``dense_mappings``: ``mappings(..., dense=True)``.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from importlib import resources

# Mapping kind (the class or a Megatron-Bridge class it derives from) -> operation; the first kind of a
# mapping's chain that is listed here decides.
_OPERATIONS = {
    "AutoMapping": "copy",
    "DirectMapping": "copy",
    "ReplicatedMapping": "copy",
    "ColumnParallelMapping": "copy",
    "RowParallelMapping": "copy",
    "QKVMapping": "qkv",
    "GatedMLPMapping": "gate_up",
    "GPTOSSMLPGateUpProjMapping": "grouped_experts",
    "GPTOSSMLPDownProjMapping": "grouped_experts",
    "_SqueezeBiasMapping": "unsqueeze",  # ERNIE 4.5's expert bias: Megatron [n], HF [1, n]
    "ConcatenatedQKVMapping": "vision_qkv",  # a vision tower's per-head [q k v] rows as HF's [q; k; v]
    "_FullDimQKNormMapping": "copy",  # MiniMax-M2's q/k norms over all heads: split over TP like a column
    "RMSNorm2ZeroCenteredRMSNormMapping": "add_one",  # the bridge adds 1 to the stored norm weight
    # Gemma 4's fused QKV, whose K and V its export drops where the HF layer has none of its own (a KV-shared
    # layer's, num_kv_shared_layers) and its V where the layer's keys are its values (attention_k_eq_v on a
    # full-attention layer): those exist only in Megatron (zeros, or a copy of K, at import)
    "_Gemma4QKVMapping": "qkv_own_kv",
    "_Gemma4DenseQKVMapping": "qkv_own_kv",
    # Experts of a layer as one HF tensor [experts, ...], each expert's matrix as stored (fc1: gate rows, up rows);
    # transposed on export (transpose_on_export), they have no operation here.
    "FusedExpertMapping": "stacked_experts",
    "FusedGatedExpertMapping": "stacked_experts",
    # ERNIE 4.5-VL's expert-score bias: one HF tensor [pools, experts], a row per expert pool (text, vision)
    "_ConcatBiasMapping": "pooled_rows",
}
# ERNIE 4.5-VL's vision-pool experts: their base class's operation, the HF expert index after the text pool's
# experts (``expert_pool_offset``).
_POOL_OFFSET_KINDS = {"_OffsetGatedMLPMapping", "_OffsetRowParallelMapping"}
# Family kinds that change values, not only names: not the operation their base class names.
_NOT_COPIES = {
    "StackedExpertAutoMapping",
    "StackedExpertGatedMLPMapping",
    "MiMoV2FlashQKVMapping",
}


@dataclass(frozen=True)
class BridgeMapping:
    """One of the bridge's parameter mappings: a Megatron name pattern and the HF name(s) it becomes."""

    kinds: tuple[str, ...]
    megatron: str  # '*': a number (layer, expert); '**': any path
    hf: dict[str, str]  # role ("" for one tensor; q/k/v; gate/up) -> HF name pattern
    permute_dims: tuple[int, ...] | None = None  # the bridge permutes the tensor's dimensions on import and back
    transpose_on_export: bool = False  # fused experts: each expert's matrix written transposed
    # A parameter saved in parts: role -> (the parts its HF tensor concatenates, whether per key head)
    parts: dict[str, tuple[tuple[str, ...], bool]] | None = None

    @property
    def operation(self) -> str | None:
        if self.parts is not None:
            return "saved_parts"
        if self.kinds[0] in _NOT_COPIES or self.transpose_on_export:
            return None
        operation = next((_OPERATIONS[k] for k in self.kinds if k in _OPERATIONS), None)
        if self.permute_dims is None:
            return operation
        # A 2-D transpose is its own inverse: export transposes back what import transposed; others have no operation.
        return "transpose" if operation == "copy" and self.permute_dims == (1, 0) else None

    @property
    def expert_pool_offset(self) -> bool:
        """The HF expert index is the Megatron one after an earlier pool's experts (ERNIE 4.5-VL's vision pool)."""
        return self.kinds[0] in _POOL_OFFSET_KINDS

    @functools.cached_property
    def pattern(self) -> re.Pattern:
        parts = re.split(r"(\*\*|\*)", self.megatron)
        return re.compile("".join("(.+)" if p == "**" else r"(\d+)" if p == "*" else re.escape(p) for p in parts))

    def hf_names(self, megatron_name: str) -> dict[str, str] | None:
        """The HF names of one Megatron name this mapping covers, its wildcards filled in order."""
        match = self.pattern.fullmatch(megatron_name)
        if match is None:
            return None
        return {role: _fill(name, match.groups()) for role, name in self.hf.items()}


def _fill(pattern: str, values: tuple[str, ...]) -> str:
    parts = re.split(r"(\*\*|\*)", pattern)
    wildcards = iter(values)
    return "".join(next(wildcards) if p in ("*", "**") else p for p in parts)


@functools.cache
def _table() -> dict:
    return json.loads(resources.files("merge_pipeline").joinpath("bridge_mappings.json").read_text())


def bridge_release() -> str:
    return _table()["megatron_bridge"]


def architectures() -> tuple[str, ...]:
    """Every HF architecture the bridge registers."""
    return tuple(_table()["architectures"])


def mappings(architecture: str, dense: bool = False) -> tuple[BridgeMapping, ...]:
    """The bridge's mappings of an architecture (empty when it does not register it); ``dense``: a dense model's,
    where the bridge keeps one of its own (Gemma 4: ``dense_mappings``)."""
    entry = _table()["architectures"].get(architecture, {})
    return tuple(
        BridgeMapping(
            tuple(m["kind"]),
            m["megatron"],
            m["hf"] if isinstance(m["hf"], dict) else {"": m["hf"]},
            tuple(dims) if (dims := m.get("params", {}).get("permute_dims")) else None,
            bool(m.get("params", {}).get("transpose_on_export")),
            {role: (tuple(p["parts"]), p["per_key_head"]) for role, p in m["parts"].items()} if "parts" in m else None,
        )
        for m in entry.get("dense_mappings" if dense and "dense_mappings" in entry else "mappings", ())
    )


def lookup(architecture: str, megatron_name: str, dense: bool = False) -> tuple[BridgeMapping, dict[str, str]] | None:
    """The bridge's mapping of one Megatron name, with its HF names; the first that matches, as the bridge
    takes it (``MegatronMappingRegistry.megatron_to_hf_lookup``)."""
    for mapping in mappings(architecture, dense):
        names = mapping.hf_names(megatron_name)
        if names is not None:
            return mapping, names
    return None
