"""Megatron-Core checkpoint keys -> Hugging Face tensor names, as row selections.

Pure bookkeeping: given every tensor key of a dist checkpoint with its global shape and the model's
``config.json``, say which rows of which stored tensors make up each HF tensor. No file is read here.

Layouts (see docs/LAYOUTS.md, "Megatron"): layers are stacked on a leading axis (``decoder.layers.<param>`` [L, ...])
or stored one key per layer (``decoder.layers.<i>.<param>``); experts likewise ([L, E, ...],
[E, ...] or ``experts.<e>.``). Fused QKV rows are ``[q heads | k | v]`` per KV group; a gated fc1 is
``[gate; up]`` or two keys ``_w`` (gate) and ``_v`` (up). Multi-token-prediction modules
(``mtp.layers.<k>.``, DeepSeek-V3) become the HF layers after the decoder's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from merge_pipeline import families
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.conversions import (
    AddOne,
    Chunk,
    ConcatenateParts,
    GroupedExperts,
    Operation,
    RegroupQKV,
    Rename,
    Reshape,
    Sizes,
    SplitQKV,
    Stored,
    Transpose,
    Unsqueeze,
    named,
)
from merge_pipeline.formats.megatron import bridge_table
from merge_pipeline.formats.output_specs import OutputSpec, Piece, whole
from merge_pipeline.hf.config import model_section, text_section


@dataclass(frozen=True)
class ModelShape:
    """The sizes the conversions need, read from config.json."""

    architecture: str
    family: families.Family
    attention_heads: int
    kv_heads: int
    head_dim: int
    vision_heads: int | None
    value_model: bool
    num_layers: int | None  # decoder layers: multi-token-prediction layer k is HF layer num_layers + k
    mtp_layers: int
    mtp_setting: str  # the config key that counts them: num_nextn_predict_layers, or Qwen3.5's mtp_num_hidden_layers
    # Gemma 4: a dense model (enable_moe_block false) has a registry of its own in the bridge's table; its
    # layers' attention types (layer_types), and its full-attention layers' KV heads and head_dim.
    dense: bool = False
    layer_types: tuple[str, ...] = ()
    global_attention: tuple[int, int] | None = None
    # A Mamba hybrid's layer pattern (Nemotron-H): each layer's type, mamba / attention / mlp / moe.
    hybrid_pattern: tuple[str, ...] = ()
    linear_key_heads: int = 0  # Gated DeltaNet's key heads (linear_num_key_heads): its fused in_proj is per key head
    keys_are_values: bool = False  # Gemma 4's attention_k_eq_v: its full-attention layers have no V of their own
    kv_shared_from: int | None = None  # Gemma 4's first layer reusing an earlier one's K, V (num_kv_shared_layers)
    experts_per_pool: int = 0  # ERNIE 4.5-VL's moe_num_experts: each expert pool's (_EXPERT_POOLS)


# What a user whose architecture is refused can do instead.
SAVE_THROUGH_THE_BRIDGE = (
    "save the weights as Hugging Face files through the bridge (verl: actor_rollout_ref.actor.megatron.use_mbridge=True, "
    "or hf_model in actor_rollout_ref.actor.checkpoint.save_contents) and merge that checkpoint"
)


def megatron_family(config: dict, config_path: Path) -> tuple[str, families.Family]:
    """The architecture config.json names and its family, if this reader maps its Megatron shards."""
    architectures = config.get("architectures") or []
    if not architectures:
        raise MergeError(config_path, "no 'architectures' entry: cannot tell which Hugging Face model this is")
    architecture = architectures[0]
    family = families.by_architecture(architecture)
    if architecture in families.MEGATRON_REFUSED:
        raise MergeError(
            config_path,
            f"{architecture} ({families.MEGATRON_REFUSED[architecture]}): its Megatron shards are not mapped to "
            f"Hugging Face names; {SAVE_THROUGH_THE_BRIDGE}",
        )
    if (family is None or not family.megatron) and architecture in families.MEGATRON_PROVEN:
        return architecture, _bridge_family(architecture)
    if family is None or not family.megatron:
        supported = ", ".join(sorted(a for f in families.FAMILIES.values() if f.megatron for a in f.architectures))
        raise MergeError(
            config_path,
            f"unsupported architecture {architecture} for Megatron checkpoints (supported: {supported}); otherwise {SAVE_THROUGH_THE_BRIDGE}",
        )
    return architecture, family


def _bridge_family(architecture: str) -> families.Family:
    """An architecture no family record maps, proven through Megatron-Bridge's own table: every name comes
    from ``bridge_table`` (``KeyMapper._map_bridge``)."""
    return families.Family(architecture, architecture, (architecture,), from_bridge=True)


_MTP_SETTINGS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")  # the second: Qwen3-Next's and Qwen3.5's


def model_shape(config: dict, config_path: Path, *, value_model: bool) -> ModelShape:
    architecture, family = megatron_family(config, config_path)
    text = text_section(config)
    try:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise MergeError(config_path, f"missing or invalid attention size {exc}") from None
    vision = model_section(config).get("vision_config") or {}
    vision_heads = vision.get("num_heads")
    num_layers = text.get("num_hidden_layers")
    mtp_setting = next((k for k in _MTP_SETTINGS if k in text), _MTP_SETTINGS[0])
    global_head_dim = text.get("global_head_dim")
    return ModelShape(
        architecture,
        family,
        heads,
        kv_heads,
        head_dim,
        vision_heads,
        value_model,
        num_layers,
        text.get(mtp_setting) or 0,
        mtp_setting,
        dense=text.get("enable_moe_block") is False,
        layer_types=tuple(text.get("layer_types") or ()),
        global_attention=(
            (int(text.get("num_global_key_value_heads") or kv_heads), int(global_head_dim)) if global_head_dim else None
        ),
        hybrid_pattern=_hybrid_pattern(text, config_path),
        linear_key_heads=int(text.get("linear_num_key_heads") or 0),
        keys_are_values=text.get("attention_k_eq_v") is True,
        kv_shared_from=_kv_shared_from(text),
        experts_per_pool=_first(text.get("moe_num_experts")),
    )


# A Mamba hybrid's config says each layer's type: transformers' layers_block_type, or the Hub's older
# hybrid_override_pattern, one symbol a layer (M mamba, * attention, - mlp, E moe; Megatron's pipeline marks | stripped).
_HYBRID_SYMBOLS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _hybrid_pattern(text: dict, config_path: Path) -> tuple[str, ...]:
    if isinstance(text.get("layers_block_type"), list):
        return tuple(text["layers_block_type"])
    pattern = text.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        return ()
    symbols = pattern.split("/")[0].replace("|", "")
    unknown = set(symbols) - set(_HYBRID_SYMBOLS)
    if unknown:
        raise MergeError(config_path, f"hybrid_override_pattern has unknown layer symbols {sorted(unknown)}")
    return tuple(_HYBRID_SYMBOLS[symbol] for symbol in symbols)


def _kv_shared_from(text: dict) -> int | None:
    """Gemma 4's first layer that reuses an earlier layer's K and V: its last num_kv_shared_layers are."""
    shared, layers = text.get("num_kv_shared_layers"), text.get("num_hidden_layers")
    return layers - shared if isinstance(shared, int) and shared > 0 and isinstance(layers, int) else None


def _first(value: object) -> int:
    """An int, or the first of a list of them (a size per expert pool); 0 when neither."""
    value = value[0] if isinstance(value, list) and value else value
    return value if isinstance(value, int) else 0


# ---- how one stored parameter becomes HF tensors --------------------------------------------------


# Each stored parameter of a layer maps through one operation of the conversion vocabulary
# (formats/conversions.py), its HF names inside the layer with the family's names as fields
# ({moe}, {expert}, ...); a gated fc1 stored as two keys (``_w`` gate, ``_v`` up) is its Chunk's halves.


# Per-layer modules of the language model. A linear's fused layer norm (``layer_norm_weight``) is the
# norm in front of it: the second entry names that norm.
_TEXT_LINEARS: dict[str, tuple[Operation, str | None]] = {
    "self_attention.linear_qkv": (
        SplitQKV("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "input_layernorm",
    ),
    "self_attention.linear_proj": (Rename("self_attn.o_proj"), None),
    "self_attention.linear_q_proj": (Rename("self_attn.q_proj"), None),
    "self_attention.linear_q_down_proj": (Rename("self_attn.q_a_proj"), None),
    "self_attention.linear_q_up_proj": (Rename("self_attn.q_b_proj"), "self_attn.q_a_layernorm"),
    "self_attention.linear_kv_down_proj": (Rename("self_attn.kv_a_proj_with_mqa"), None),
    "self_attention.linear_kv_up_proj": (Rename("self_attn.kv_b_proj"), "self_attn.kv_a_layernorm"),
    "mlp.linear_fc1": (Chunk("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    "mlp.linear_fc2": (Rename("mlp.down_proj"), None),
    "mlp.router": (Rename("{moe}.{router}"), None),
    "mlp.shared_experts.linear_fc1": (Chunk("mlp.{shared}.gate_proj", "mlp.{shared}.up_proj"), None),
    "mlp.shared_experts.linear_fc2": (Rename("mlp.{shared}.down_proj"), None),
    "mlp.experts.linear_fc1": (Chunk("{moe}.experts.{expert}.{gate}", "{moe}.experts.{expert}.{up}"), None),
    "mlp.experts.linear_fc2": (Rename("{moe}.experts.{expert}.{down}"), None),
    "input_layernorm": (Rename("input_layernorm"), None),
    "pre_mlp_layernorm": (Rename("post_attention_layernorm"), None),
    "self_attention.q_layernorm": (Rename("self_attn.q_norm"), None),
    "self_attention.k_layernorm": (Rename("self_attn.k_norm"), None),
    "self_attention.kv_layernorm": (Rename("self_attn.kv_a_layernorm"), None),
}

# Attributes that are not weight/bias of the module itself.
_SPECIAL_ATTRIBUTES = {
    ("mlp.router", "expert_bias"): "mlp.gate.e_score_correction_bias",
    ("mlp.shared_experts", "gate_weight"): "mlp.shared_expert_gate.weight",
}

# Attention sinks (gpt-oss): megatron-core's learnable softmax offset, one logit per head.
_SINKS = ("self_attention.core_attention", "softmax_offset")

# Grouped experts (gpt-oss): each layer's experts as one HF tensor per kind, in HF's transposed layout
# (formats/expert_matrices.py). (module, attribute) -> HF name inside the layer's MoE block.
_GROUPED_EXPERTS = {
    ("mlp.experts.linear_fc1", "weight"): "experts.gate_up_proj",
    ("mlp.experts.linear_fc1", "bias"): "experts.gate_up_proj_bias",
    ("mlp.experts.linear_fc2", "weight"): "experts.down_proj",
    ("mlp.experts.linear_fc2", "bias"): "experts.down_proj_bias",
}

# Multi-latent attention has no separate q/k norms: its q_layernorm normalises the compressed query.
_MLA_RENAMES = {"self_attention.q_layernorm": Rename("self_attn.q_a_layernorm")}

_VISION_LINEARS: dict[str, tuple[Operation, str | None]] = {
    "self_attention.linear_qkv": (RegroupQKV("attn.qkv"), "norm1"),
    "self_attention.linear_proj": (Rename("attn.proj"), None),
    "mlp.linear_fc1": (Chunk("mlp.gate_proj", "mlp.up_proj"), "norm2"),
    "mlp.linear_fc2": (Rename("mlp.down_proj"), None),
}

_VISION_GLOBALS = {
    "patch_embed.proj": "patch_embed.proj",
    "decoder.final_layernorm": "merger.ln_q",
    "projection.encoder.linear_fc1": "merger.mlp.0",
    "projection.encoder.linear_fc2": "merger.mlp.2",
}

# Multi-token prediction (DeepSeek-V3): megatron-core's MTP module k is HF layer num_hidden_layers + k, holding
# the norms of its two inputs, their projection, a decoder layer and the norm before the shared output head.
_MTP_KEY = re.compile(r"mtp\.layers\.(?P<module>\d+)\.(?P<param>.+)")
_MTP_MODULES = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "final_layernorm": "shared_head.norm"}

_LAYER_KEY = re.compile(r"decoder\.layers\.(?:(?P<layer>\d+)\.)?(?P<param>.+)")
# megatron-core saves a multi-token-prediction module's decoder layer as ``mtp.layers.<k>.transformer_layer.``;
# Megatron-Bridge's registry names it ``mtp.layers.<k>.mtp_model_layer.`` (its attribute in memory).
_BRIDGE_MTP_LAYER = re.compile(r"(?P<model>.*?)mtp\.layers\.(?P<module>\d+)\.transformer_layer\.(?P<param>.+)")
# megatron-core's hybrid model saves each layer under its own index, its type in its modules' names.
_HYBRID_MODULES = (
    ("mixer.", "mamba"),
    ("self_attention.", "attention"),
    ("mlp.router.", "moe"),
    ("mlp.experts.", "moe"),
    ("mlp.shared_experts.", "moe"),
    ("mlp.", "mlp"),
)
# Experts: stacked (experts.experts.linear_fc1 [E, ...]) or one key each (experts[.experts].<e>.linear_fc1); in one
# of several pools (ERNIE 4.5-VL's mlp.text_moe_layer., mlp.vision_moe_layer.: _EXPERT_POOLS).
_EXPERT_PARAM = re.compile(
    r"mlp\.(?P<pool>\w+_moe_layer\.)?experts\.(?:experts\.|local_experts\.)?(?:(?P<expert>\d+)\.)?"
    r"(?P<rest>linear_fc[12]\..+)"
)
# ERNIE 4.5-VL's expert pools in Hugging Face's order: the vision pool's experts follow the text pool's
# (HF expert e + moe_num_experts), and its expert-score bias holds a row per pool.
_EXPERT_POOLS = ("mlp.text_moe_layer.", "mlp.vision_moe_layer.")
# One expert's HF name in Megatron-Bridge's table: ``<...>.experts.<e>.gate_proj.weight`` (or up / down).
_EXPERT_NUMBER = re.compile(r"(?<=\.experts\.)\d+(?=\.)")
_PER_EXPERT = re.compile(r"(?P<experts>.+\.experts\.)(?P<expert>\d+)\.(?:gate|up|down)_proj\.weight")
# Gemma 4's attention saved per layer type (the bridge's ``Gemma4DenseSelfAttention.sharded_state_dict``):
# ``self_attention_sliding.*`` stacks the sliding layers' copies, ``self_attention_global.*`` the full-attention
# layers'; config.json's ``layer_types`` says which layers those are.
_TYPED_ATTENTION = re.compile(r"self_attention_(?P<type>sliding|global)\.(?P<param>.+)")
_LAYER_TYPES = {"sliding": "sliding_attention", "global": "full_attention"}
_ATTRIBUTE = re.compile(
    r"(?P<module>.+)\.(?P<attr>layer_norm_(?:weight|bias)|weight|bias|expert_bias|gate_weight|softmax_offset|A_log|D|dt_bias)"
    r"(?P<half>_[wv])?(?:\.(?P<part>[A-Za-z]+))?"
)


@dataclass(frozen=True)
class _LayerParam:
    """One layer's (and one expert's) copy of a stored parameter."""

    layer: int
    expert: int | None
    module: str  # e.g. "self_attention.linear_qkv", "mlp.experts.linear_fc1"
    attr: str  # weight, bias, layer_norm_weight, expert_bias, ...
    half: str  # "", "_w" (gate) or "_v" (up)
    key: str
    index: tuple[int, ...]
    shape: tuple[int, ...]
    part: str = ""  # a named part of a fused tensor (Mamba's in_proj.weight.z): ConcatenateParts gathers it

    @property
    def stored(self) -> Stored:
        return Stored(self.key, self.shape, self.index)

    @property
    def rows(self) -> int:
        return self.stored.rows


def _layer_params(key: str, layer_key: str, shape: tuple[int, ...]) -> Iterator[_LayerParam] | None:
    """Expand a ``decoder.layers...`` key into one entry per layer (and expert); None if unparsable."""
    match = _LAYER_KEY.fullmatch(layer_key)
    if match is None:
        return None
    param = match["param"]
    expert_match = _EXPERT_PARAM.fullmatch(param)
    expert: int | None = None
    stacked_experts = False
    if expert_match is not None:
        param = f"mlp.{expert_match['pool'] or ''}experts.{expert_match['rest']}"
        if expert_match["expert"] is not None:
            expert = int(expert_match["expert"])
        else:
            stacked_experts = True
    attribute = _ATTRIBUTE.fullmatch(param)
    if attribute is None:
        return None
    module, attr, half, part = attribute["module"], attribute["attr"], attribute["half"] or "", attribute["part"] or ""
    layers = [int(match["layer"])] if match["layer"] is not None else None
    leading = (0 if layers else 1) + (1 if stacked_experts else 0)
    if len(shape) <= leading:
        return None

    def expand() -> Iterator[_LayerParam]:
        for layer_pos, layer in enumerate(layers or range(shape[0])):
            layer_index = () if layers else (layer_pos,)
            experts = range(shape[len(layer_index)]) if stacked_experts else [expert]
            for e in experts:
                index = layer_index + ((e,) if stacked_experts else ())
                yield _LayerParam(layer, e, module, attr, half, key, index, shape, part)

    return expand()


# Megatron-Bridge's operations (bridge_table) by the vocabulary's, from a mapping's HF names by role.
_BRIDGE_OPERATIONS = {
    "copy": lambda hf: Rename(hf[""]),
    "qkv": lambda hf: SplitQKV(hf["q"], hf["k"], hf["v"], output_gate=True),
    "qkv_own_kv": lambda hf: SplitQKV(hf["q"], hf["k"], hf["v"]),  # less the K, V a layer lacks: _bridge_outputs
    "gate_up": lambda hf: Chunk(hf["gate"], hf["up"]),
    "vision_qkv": lambda hf: RegroupQKV(hf[""]),
    "unsqueeze": lambda hf: Unsqueeze(hf[""]),
    "transpose": lambda hf: Transpose(hf[""]),
    "add_one": lambda hf: AddOne(hf[""]),
}


class KeyMapper:
    """Turns the stored keys of one checkpoint into ``OutputSpec``s for one HF architecture."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], model: ModelShape, config_path: Path, metadata_path: Path):
        self.shapes = shapes
        self.model = model
        self.config_path = config_path
        self.metadata_path = metadata_path
        self.sizes = Sizes(
            config_path,
            metadata_path,
            model.attention_heads,
            model.kv_heads,
            model.head_dim,
            model.vision_heads,
            model.linear_key_heads,
        )
        kv_heads, head_dim = model.global_attention or (model.kv_heads, model.head_dim)
        self.global_sizes = replace(self.sizes, kv_heads=kv_heads, head_dim=head_dim)  # Gemma 4's full attention
        self.mtp_modules = sorted({int(m["module"]) for k in shapes if (m := _MTP_KEY.fullmatch(k))})
        # Grouped experts' pieces, gathered from every key: HF name -> [((expert, half), piece, module)]
        self.grouped: dict[str, list[tuple[tuple[int, int], Piece, str]]] = {}
        # Experts stacked as they are stored (families.BRIDGE_STACKED_EXPERTS): HF name -> [(expert, piece)]
        self.stacked: dict[str, list[tuple[int, Piece]]] = {}
        # Fused tensors saved as named parts (Mamba's in_proj, conv1d): operation -> {part: stored}
        self.parts: dict[ConcatenateParts, dict[str, Stored]] = {}

    def outputs(self) -> list[OutputSpec]:
        if self.mtp_modules and len(self.mtp_modules) != self.model.mtp_layers:
            raise MergeError(
                self.config_path,
                f"the checkpoint has {len(self.mtp_modules)} multi-token-prediction module(s) (mtp.layers.*) "
                f"but {self.model.mtp_setting} is {self.model.mtp_layers}",
            )
        self._check_hybrid_pattern()
        specs: list[OutputSpec] = []
        unmapped: list[str] = []
        for key, shape in self.shapes.items():
            mapped = self._map_key(key, shape)
            if mapped is None:
                unmapped.append(key)
            else:
                specs.extend(mapped)
        specs.extend(self._grouped_experts())
        specs.extend(self._stacked_experts())
        specs.extend(operation.of(found, self.sizes) for operation, found in self.parts.items())
        if unmapped:
            shown = ", ".join(unmapped[:8]) + (f" (+{len(unmapped) - 8} more)" if len(unmapped) > 8 else "")
            raise MergeError(
                self.metadata_path,
                f"{len(unmapped)} checkpoint tensor(s) have no Hugging Face name for {self.model.architecture}: {shown}",
            )
        seen: dict[str, str] = {}
        for spec in specs:
            first = spec.pieces[0].key
            if spec.name in seen:
                raise MergeError(self.metadata_path, f"both {seen[spec.name]} and {first} map to {spec.name}")
            seen[spec.name] = first
        return specs

    def _check_hybrid_pattern(self) -> None:
        """Each stored layer of a Mamba hybrid is of the type config.json's layer pattern gives its index: the HF
        names follow the stored modules, transformers builds each layer by the pattern."""
        pattern = self.model.hybrid_pattern
        if not pattern:
            return
        stored: dict[int, dict[str, str]] = {}  # layer -> its types -> a key of each
        for key in self.shapes:
            match = _LAYER_KEY.fullmatch(key)
            if match is None or match["layer"] is None:
                continue
            kind = next((kind for prefix, kind in _HYBRID_MODULES if match["param"].startswith(prefix)), None)
            if kind is not None:
                stored.setdefault(int(match["layer"]), {}).setdefault(kind, key)
        for layer, kinds in sorted(stored.items()):
            expected = pattern[layer] if layer < len(pattern) else "not a layer"
            if set(kinds) != {expected}:
                found = ", ".join(f"{kind} ({key})" for kind, key in kinds.items())
                raise MergeError(
                    self.config_path,
                    f"layer {layer} is {expected} in the layer pattern ({len(pattern)} layers), the checkpoint holds {found}",
                )

    # ---- dispatch by scope ----

    def _map_key(self, key: str, shape: tuple[int, ...]) -> list[OutputSpec] | None:
        if self.model.family.from_bridge:
            return self._map_bridge(key, shape)
        if self.model.family.vision_prefix is None:
            return self._map_text(key, key, shape)
        if key.startswith("language_model."):
            return self._map_text(key, key.removeprefix("language_model."), shape)
        if key.startswith("vision_model."):
            return self._map_vision(key, key.removeprefix("vision_model."), shape)
        return self._map_bridge(key, shape)  # a tower the bridge keeps as transformers' own module (visual.*)

    def _map_text(self, key: str, local: str, shape: tuple[int, ...]) -> list[OutputSpec] | None:
        prefix = self.model.family.text_prefix
        top_level = {
            "embedding.word_embeddings.weight": f"{prefix}embed_tokens.weight",
            "decoder.final_layernorm.weight": f"{prefix}norm.weight",
            "output_layer.weight": "score.weight" if self.model.value_model else "lm_head.weight",
        }
        if self.model.value_model:
            top_level["output_layer.bias"] = "score.bias"
        if local in top_level:
            return [whole(top_level[local], key, shape[0])] + [
                whole(name, key, shape[0]) for name in self._mtp_copies_of_shared(local)
            ]
        mtp = _MTP_KEY.fullmatch(local)
        if mtp is not None:
            return self._map_mtp(key, int(mtp["module"]), mtp["param"], shape)
        return self._map_text_layers(_layer_params(key, local, shape))

    def _map_text_layers(self, params: Iterator[_LayerParam] | None) -> list[OutputSpec] | None:
        if params is None:
            return None
        out: list[OutputSpec] = []
        for p in params:
            mapped = self._map_text_layer(p)
            if mapped is None:
                return None
            out.extend(mapped)
        return out

    def _map_mtp(self, key: str, module: int, param: str, shape: tuple[int, ...]) -> list[OutputSpec] | None:
        if self.model.num_layers is None:
            return None
        layer = self.model.num_layers + module
        name, _, attr = param.rpartition(".")
        if name in _MTP_MODULES and attr == "weight":
            return [whole(f"{self.model.family.text_prefix}layers.{layer}.{_MTP_MODULES[name]}.weight", key, shape[0])]
        if not param.startswith("transformer_layer."):
            return None
        local = f"decoder.layers.{layer}.{param.removeprefix('transformer_layer.')}"
        return self._map_text_layers(_layer_params(key, local, shape))

    def _mtp_copies_of_shared(self, local: str) -> list[str]:
        """MTP layers share the embedding and the output head; DeepSeek-V3's checkpoints (and vLLM's
        loader) still have both under each MTP layer, as ``embed_tokens`` and ``shared_head.head``."""
        if not self.mtp_modules or self.model.num_layers is None:
            return []
        if local == "embedding.word_embeddings.weight":
            names = ["embed_tokens"] if "output_layer.weight" in self.shapes else ["embed_tokens", "shared_head.head"]
        elif local == "output_layer.weight" and not self.model.value_model:
            names = ["shared_head.head"]
        else:
            return []
        prefix = self.model.family.text_prefix
        return [f"{prefix}layers.{self.model.num_layers + k}.{name}.weight" for k in self.mtp_modules for name in names]

    def _map_vision(self, key: str, local: str, shape: tuple[int, ...]) -> list[OutputSpec] | None:
        prefix = self.model.family.vision_prefix
        module, _, attr = local.rpartition(".")
        if module in _VISION_GLOBALS and attr in ("weight", "bias"):
            return [whole(f"{prefix}{_VISION_GLOBALS[module]}.{attr}", key, shape[0])]
        params = _layer_params(key, local, shape)
        if params is None:
            return None
        out: list[OutputSpec] = []
        for p in params:
            mapped = self._convert(p, _VISION_LINEARS, f"{prefix}blocks.{p.layer}.")
            if mapped is None:
                return None
            out.extend(mapped)
        return out

    def _map_bridge(self, key: str, shape: tuple[int, ...]) -> list[OutputSpec] | None:
        """A key by Megatron-Bridge's own mapping of its name (``bridge_table``), one layer and expert at a time
        under the name the bridge's registry uses (``decoder.layers.<i>.``, ``local_experts.<e>.``)."""
        model, layers, rest = key.rpartition("decoder.layers.")  # model: a multimodal model's language_model.
        in_layer = "{model}decoder.layers.{layer}."
        mtp = _BRIDGE_MTP_LAYER.fullmatch(key)
        if mtp is not None:  # a multi-token-prediction module's decoder layer, as one decoder layer
            model, layers, rest = mtp["model"], "decoder.layers.", f"{mtp['module']}.{mtp['param']}"
            in_layer = "{model}mtp.layers.{layer}.mtp_model_layer."
        typed = _TYPED_ATTENTION.fullmatch(rest) if layers else None
        if typed is not None:
            return self._bridge_typed_attention(key, model, typed, shape)
        params = _layer_params(key, layers + rest, shape) if layers else None
        if params is None:
            whole_key = self._bridge_outputs(key, _LayerParam(0, None, "", "", "", key, (), shape))
            return whole_key if whole_key is not None else self._bridge_stacked(key, shape)
        out: list[OutputSpec] = []
        for p in params:
            layer = in_layer.format(model=model, layer=p.layer)
            names = [f"{layer}{p.module}.{p.attr}"]
            if p.expert is not None:  # SequentialMLP's name, or TransformerEngine's grouped one (weight<expert>)
                local = p.module.replace(".experts.", f".experts.local_experts.{p.expert}.", 1)
                names = [f"{layer}{local}.{p.attr}", f"{layer}{p.module}.{p.attr}{p.expert}"]
            mapped = next((m for name in names if (m := self._bridge_outputs(name, p)) is not None), None)
            if mapped is None:
                return None
            out.extend(mapped)
        return out

    def _bridge_typed_attention(
        self, key: str, model: str, typed: re.Match, shape: tuple[int, ...]
    ) -> list[OutputSpec] | None:
        """Gemma 4's attention of one layer type (``_TYPED_ATTENTION``): copy ``i`` is the ``i``-th layer of that
        type, under the bridge's ``self_attention`` name, split by that type's sizes."""
        layer_type = _LAYER_TYPES[typed["type"]]
        layers = [i for i, t in enumerate(self.model.layer_types) if t == layer_type]
        params = _layer_params(key, f"decoder.layers.self_attention.{typed['param']}", shape)
        if params is None:
            return None
        if len(layers) != shape[0]:
            raise MergeError(
                self.config_path,
                f"layer_types has {len(layers)} {layer_type} layer(s), the checkpoint's {key} stacks {shape[0]}",
            )
        sizes = self.global_sizes if layer_type == "full_attention" else self.sizes
        out: list[OutputSpec] = []
        for p in params:
            p = replace(p, layer=layers[p.layer])
            mapped = self._bridge_outputs(f"{model}decoder.layers.{p.layer}.{p.module}.{p.attr}", p, sizes)
            if mapped is None:
                return None
            out.extend(mapped)
        return out

    def _bridge_stacked(self, key: str, shape: tuple[int, ...]) -> list[OutputSpec] | None:
        """A module list megatron-core saves stacked, its index the leading dimension (Qwen3-VL's
        ``deepstack_merger_list``): the index goes where the bridge's name of the first entry has it."""
        if len(shape) < 2:
            return None
        parts = key.split(".")
        for cut in range(1, len(parts)):
            named_entries = [".".join([*parts[:cut], str(i), *parts[cut:]]) for i in range(shape[0])]
            if bridge_table.lookup(self.model.architecture, named_entries[0], self.model.dense) is None:
                continue
            out: list[OutputSpec] = []
            for i, name in enumerate(named_entries):
                mapped = self._bridge_outputs(name, _LayerParam(0, None, "", "", "", key, (i,), shape))
                if mapped is None:
                    return None
                out.extend(mapped)
            return out
        return None

    def _bridge_outputs(self, name: str, p: _LayerParam, sizes: Sizes | None = None) -> list[OutputSpec] | None:
        found = bridge_table.lookup(self.model.architecture, name, self.model.dense)
        if found is None:
            return None
        mapping, hf = found
        stacked = _PER_EXPERT.fullmatch(hf.get("gate") or hf.get("") or "")
        if self.model.architecture in families.BRIDGE_STACKED_EXPERTS and stacked and not p.half:
            gathered = stacked["experts"] + ("gate_up_proj" if mapping.operation == "gate_up" else "down_proj")
            self.stacked.setdefault(gathered, []).append((int(stacked["expert"]), p.stored.piece()))
            return []
        if mapping.operation == "stacked_experts":  # gathered per layer, written by outputs()
            if p.expert is None or p.half:
                return None
            self.stacked.setdefault(hf[""], []).append((p.expert, p.stored.piece()))
            return []
        pool = next((i for i, pool in enumerate(_EXPERT_POOLS) if pool in name), None)
        if mapping.operation == "pooled_rows":  # a row per expert pool, gathered like stacked experts
            if pool is None:
                return None
            self.stacked.setdefault(hf[""], []).append((pool, p.stored.piece()))
            return []
        if mapping.expert_pool_offset:  # the HF expert after the earlier pools' experts
            if pool is None or not self.model.experts_per_pool:
                return None
            offset = pool * self.model.experts_per_pool
            hf = {role: _EXPERT_NUMBER.sub(lambda m: str(int(m[0]) + offset), n, count=1) for role, n in hf.items()}
        if mapping.operation == "vision_qkv" and not name.startswith("vision_model."):
            return None  # the regrouping is a vision tower's layout
        if mapping.operation == "saved_parts":
            return self._saved_part(mapping.parts, hf, p)
        if hf.get("", "").endswith(".self_attn.k_norm.weight") and "k" in self._absent_kv(p.layer):
            return []  # a KV-shared layer's K norm: Megatron's own, which the bridge's export drops
        operation = _BRIDGE_OPERATIONS.get(mapping.operation)
        if operation is None:
            return None
        operation = operation(hf)
        if mapping.operation == "qkv_own_kv":  # as the bridge's export drops them
            operation = replace(operation, absent=self._absent_kv(p.layer))
        return self._apply(operation, p, sizes)

    def _saved_part(
        self, parts: dict[str, tuple[tuple[str, ...], bool]], hf: dict[str, str], p: _LayerParam
    ) -> list[OutputSpec] | None:
        """One part of a parameter megatron-core saves as named parts, each whole over TP (its sharded_state_dict's
        _split_tensor_factory: Mamba's in_proj ``.z .x .B .C .dt``, Gated DeltaNet's ``.query .key ...``), kept for
        each HF tensor whose parts name it (``BridgeMapping.parts``, found by the generator), written by outputs()."""
        takers = [
            ConcatenateParts(hf[role], names, per_key_head)
            for role, (names, per_key_head) in parts.items()
            if p.part in names
        ]
        if not takers:  # saved whole (its TP ranks' blocks would interleave the parts), or a part no HF tensor takes
            return None
        for operation in takers:
            self.parts.setdefault(operation, {})[p.part] = p.stored
        return []

    def _absent_kv(self, layer: int) -> tuple[str, ...]:
        """The K / V projections Gemma 4's HF model lacks at ``layer``, which exist only in Megatron (the bridge's
        ``_is_synthesized_kv_projection``): K and V of a layer reusing an earlier layer's (num_kv_shared_layers), V of
        a full-attention layer whose keys are its values (attention_k_eq_v)."""
        if self.model.kv_shared_from is not None and layer >= self.model.kv_shared_from:
            return ("k", "v")
        types = self.model.layer_types
        full = layer < len(types) and types[layer] == "full_attention"
        return ("v",) if self.model.keys_are_values and full else ()

    # ---- one layer's parameter ----

    def _map_text_layer(self, p: _LayerParam) -> list[OutputSpec] | None:
        if p.part:  # a fused tensor's named part: the bridge's table maps those
            return None
        family = self.model.family
        layer_prefix = f"{family.text_prefix}layers.{p.layer}."
        special = _SPECIAL_ATTRIBUTES.get((p.module, p.attr))
        if special is not None:
            return Rename(layer_prefix + special).outputs(p.stored, self.sizes)
        if family.attention_sinks and (p.module, p.attr) == _SINKS:
            return Rename(layer_prefix + "self_attn.sinks").outputs(p.stored, self.sizes)
        grouped = _GROUPED_EXPERTS.get((p.module, p.attr)) if family.grouped_experts else None
        if grouped is not None and p.expert is not None:  # gathered per layer, written by outputs()
            half = 1 if p.half == "_v" else 0  # fc1 as two keys: gate (_w) rows before up (_v)
            piece = p.stored.piece()
            self.grouped.setdefault(f"{layer_prefix}{family.moe_block}.{grouped}", []).append(
                ((p.expert, half), piece, p.module)
            )
            return []
        table = _TEXT_LINEARS
        if self.model.family.latent_attention and p.module in _MLA_RENAMES:
            table = {**_TEXT_LINEARS, p.module: (_MLA_RENAMES[p.module], None)}
        return self._convert(p, table, layer_prefix)

    def _convert(
        self, p: _LayerParam, table: dict[str, tuple[Operation, str | None]], prefix: str
    ) -> list[OutputSpec] | None:
        entry = table.get(p.module)
        if entry is None:
            return None
        operation, fused_norm = entry
        if p.attr.startswith("layer_norm_"):
            if fused_norm is None or p.half:
                return None
            return Rename(f"{prefix}{fused_norm}.{p.attr.removeprefix('layer_norm_')}").outputs(p.stored, self.sizes)
        if p.attr not in ("weight", "bias"):
            return None
        family = self.model.family
        names = dict(zip(("gate", "up", "down"), family.expert_linears, strict=True))
        names.update(shared=family.shared_experts, expert=p.expert, moe=family.moe_block, router=family.router)
        return self._apply(named(operation, lambda name: f"{prefix}{name.format(**names)}.{p.attr}"), p)

    def _apply(self, operation: Operation, p: _LayerParam, sizes: Sizes | None = None) -> list[OutputSpec] | None:
        """The HF tensors of ``p`` by ``operation`` (split by ``sizes``, the model's unless given); a half of a gated
        fc1 (``_w``, ``_v``) is its Chunk's half."""
        sizes = sizes or self.sizes
        if p.part:  # only a ConcatenateParts takes a part
            return None
        if not p.half:
            return operation.outputs(p.stored, sizes)
        if isinstance(operation, Chunk):
            return Rename(operation.gate if p.half == "_w" else operation.up).outputs(p.stored, sizes)
        return None

    def _grouped_experts(self) -> list[OutputSpec]:
        """Each layer's experts of one kind as one HF tensor, expert 0 first."""
        specs = []
        for name, found in self.grouped.items():
            found.sort(key=lambda entry: entry[0])
            experts = sorted({expert for (expert, _), _, _ in found})
            if experts != list(range(len(experts))):
                raise MergeError(
                    self.metadata_path, f"{name}: the checkpoint holds experts {experts}, not 0 to {len(experts) - 1}"
                )
            pieces = tuple(piece for _, piece, _ in found)
            rows = {piece.rows[1] for piece in pieces}
            if len(rows) != 1 or len(pieces) % len(experts):
                raise MergeError(self.metadata_path, f"{name}: its experts' stored tensors differ in size")
            fc1 = found[0][2] == "mlp.experts.linear_fc1"
            if fc1 and rows.pop() * len(pieces) // len(experts) % 2:
                raise MergeError(self.metadata_path, f"{pieces[0].key}: gated fc1 has an odd number of rows")
            if name.endswith("down_proj_bias"):  # [E, hidden]: the stored rows, one expert after another
                width = pieces[0].rows[1]
                specs.append(Reshape(name, (len(experts), width)).of(pieces))
            else:
                transpose = name.endswith(("gate_up_proj", "down_proj"))
                specs.append(GroupedExperts(name, transpose, interleave_halves=fc1).of(pieces, len(experts)))
        return specs

    def _stacked_experts(self) -> list[OutputSpec]:
        """Each layer's experts as one [experts, rows, ...] tensor of their stored matrices, expert 0 first."""
        specs = []
        for name, found in self.stacked.items():
            found.sort(key=lambda entry: entry[0])
            if [expert for expert, _ in found] != list(range(len(found))):
                raise MergeError(self.metadata_path, f"{name}: the checkpoint holds experts {[e for e, _ in found]}")
            first = found[0][1]
            stored = self.shapes[first.key][len(first.index) :]
            specs.append(Reshape(name, (len(found), *stored)).of(tuple(piece for _, piece in found)))
        return specs
