"""The tensors a Hugging Face architecture expects, and a check of a plan against them.

The model is built from config.json on the meta device (no memory, no weights), so the expected
names and shapes come from transformers itself, for any backend. Names are the on-disk checkpoint
names: transformers 5 fuses some weights in memory (MoE experts) and un-fuses them when saving,
and we apply the same reversal; a name that loading puts one to one into a parameter of the same
shape is right too (``hf/load_names.py``: where the reversal is not loading's inverse).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
from transformers.core_model_loading import revert_weight_conversion

from merge_pipeline.errors import MergeError, first_line
from merge_pipeline.hf.load_names import LoadNames
from merge_pipeline.plan import Computed, PlannedTensor


class ExpectedTensors(dict[str, tuple[int, ...]]):
    """Name -> shape of every tensor the architecture holds.

    ``optional`` are names that may be left out: a tied weight is one parameter under two names
    (``lm_head.weight`` and ``model.embed_tokens.weight``), and a checkpoint may store either
    or both. Each of ``all_or_none_groups`` is either wholly present or wholly absent (a
    multi-token-prediction layer: trained or not). ``load_names`` says which planned names load one
    to one into which in-memory tensor.
    """

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        tied_groups: list[set[str]],
        all_or_none_groups: list[set[str]] = (),
        load_names: LoadNames | None = None,
    ):
        super().__init__(shapes)
        self.tied_groups = tied_groups
        self.all_or_none_groups = list(all_or_none_groups)
        self.load_names = load_names

    def loaded_aliases(self, planned: Iterable[str]) -> dict[str, str]:
        """Planned names that are not expected but that loading treats as an in-memory tensor or as an
        expected name -> that name (``LoadNames.aliases``)."""
        unexpected = [name for name in planned if name not in self]
        return self.load_names.aliases(unexpected) if self.load_names and unexpected else {}

    def present(self, planned: Iterable[str], aliases: dict[str, str]) -> set[str]:
        """The planned names, and the expected (and in-memory) names the aliases stand for."""
        present = set(planned) | set(aliases.values())
        return present | (self.load_names.covered(aliases.values()) if aliases else set())

    def doubles(self, planned: Iterable[str], aliases: dict[str, str]) -> list[str]:
        """Pairs of planned names that load into the same tensor (one would silently overwrite the other)."""
        planned = set(planned)
        first: dict[str, str] = {}
        doubles = []
        for name, target in sorted(aliases.items()):
            same = target if target in planned else self.load_names.saved_name.get(target)
            if same in planned or target in first:
                doubles.append(f"{name} and {same if same in planned else first[target]}")
            first.setdefault(target, name)
        return doubles

    def shape_of(self, name: str) -> tuple[int, ...]:
        """An expected name's shape, or an in-memory tensor's."""
        return self[name] if name in self else self.load_names.memory[name]


def expected_tensors(config_dir: Path, *, value_model: bool, trust_remote_code: bool) -> ExpectedTensors:
    config_path = Path(config_dir) / "config.json"
    try:
        config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise MergeError(config_path, f"transformers cannot read it: {first_line(exc)}") from None
    if value_model:
        config.num_labels = 1
    chosen = model_class(config, config_path, value_model=value_model, trust_remote_code=trust_remote_code)
    try:
        with torch.device("meta"):
            model = (
                chosen.from_config(config, trust_remote_code=trust_remote_code)
                if chosen.__name__.startswith("Auto")
                else chosen(config)
            )
    except Exception as exc:  # a config transformers accepts but cannot build from: name it, whatever the cause
        raise MergeError(
            config_path,
            f"cannot build {getattr(chosen, '__name__', chosen)} from it ({type(exc).__name__}: {first_line(exc)})",
        ) from None
    state = model.state_dict(keep_vars=True)  # parameters themselves, so tied names share one object
    saved = revert_weight_conversion(model, state)
    shapes = {name: tuple(tensor.shape) for name, tensor in saved.items()}
    mtp_layers = _multi_token_prediction_layers(config, shapes)
    for layer in mtp_layers:
        shapes.update(layer)
    load_names = LoadNames(model, {name: tuple(tensor.shape) for name, tensor in state.items()}, shapes)
    # Tied names in memory and as saved: a renamed tensor is the same object (Gemma 3 VL's lm_head.weight is saved
    # as language_model.lm_head.weight, tied to language_model.model.embed_tokens.weight).
    tied = _tied_groups(state) + _tied_groups(saved)
    return ExpectedTensors(shapes, tied, [set(layer) for layer in mtp_layers], load_names)


def _tied_groups(tensors: dict[str, torch.Tensor]) -> list[set[str]]:
    """The sets of names that hold one tensor object."""
    groups: dict[int, set[str]] = {}
    for name, tensor in tensors.items():
        groups.setdefault(id(tensor), set()).add(name)
    return [group for group in groups.values() if len(group) > 1]


def _multi_token_prediction_layers(config, shapes: dict[str, tuple[int, ...]]) -> list[dict[str, tuple[int, ...]]]:
    """DeepSeek-V3's MTP layers (``num_nextn_predict_layers``): transformers builds none and skips them
    on load, but checkpoints keep them (vLLM / SGLang load them for speculative decoding). Layer
    ``num_hidden_layers + k`` is a decoder layer like the last one, plus the norms of its two inputs,
    their projection, the head's norm, and copies of the embedding and the output head."""
    prefixes = multi_token_prediction_prefixes(config)
    if not prefixes:
        return _top_level_mtp_layers(config, shapes)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    hidden, vocab = config.hidden_size, config.vocab_size
    layers = []
    for prefix in prefixes:
        layer = {prefix + name.removeprefix(last): shape for name, shape in shapes.items() if name.startswith(last)}
        for name, shape in (
            ("enorm", (hidden,)),
            ("hnorm", (hidden,)),
            ("eh_proj", (hidden, 2 * hidden)),
            ("shared_head.norm", (hidden,)),
            ("shared_head.head", (vocab, hidden)),
            ("embed_tokens", (vocab, hidden)),
        ):
            layer[f"{prefix}{name}.weight"] = shape
        layers.append(layer)
    return layers


def _top_level_mtp_layers(config, shapes: dict[str, tuple[int, ...]]) -> list[dict[str, tuple[int, ...]]]:
    """Qwen3-Next's and Qwen3.5's MTP layers (``mtp_num_hidden_layers``), which transformers builds none of and skips
    on load (``mtp.*``): the projection of [embedding; hidden] (``mtp.fc``), the norms of its two inputs and of its
    output, and ``mtp.layers.<k>.``, each a decoder layer like the last full-attention one. One group: all or none."""
    text = config.get_text_config()
    count = getattr(text, "mtp_num_hidden_layers", None) or 0
    full = [i for i, kind in enumerate(getattr(text, "layer_types", None) or ()) if kind == "full_attention"]
    if not count or not full:
        return []
    last = next((n.split(f"layers.{full[-1]}.")[0] for n in shapes if f"layers.{full[-1]}.self_attn." in n), None)
    if last is None:
        return []
    last += f"layers.{full[-1]}."
    hidden = text.hidden_size
    layer = {
        f"mtp.layers.{k}.{name.removeprefix(last)}": shape
        for k in range(count)
        for name, shape in shapes.items()
        if name.startswith(last)
    }
    layer["mtp.fc.weight"] = (hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        layer[f"mtp.{norm}.weight"] = (hidden,)
    return [layer]


def multi_token_prediction_prefixes(config) -> tuple[str, ...]:
    """``model.layers.<num_hidden_layers + k>.`` for each MTP layer config.json declares (none for most models)."""
    count = getattr(config, "num_nextn_predict_layers", None) or 0
    return tuple(f"model.layers.{config.num_hidden_layers + k}." for k in range(count))


def model_class(config, config_path: Path, *, value_model: bool, trust_remote_code: bool):
    """The class to build from a config (the one rule for the merge's check and the folder checks): the
    architecture config.json names, or an Auto class for value models (verl's critic config still
    names the causal LM) and remote-code models."""
    if value_model:
        return AutoModelForTokenClassification
    architectures = getattr(config, "architectures", None) or []
    if architectures and hasattr(transformers, architectures[0]):
        return getattr(transformers, architectures[0])
    if trust_remote_code or not architectures:
        return AutoModelForCausalLM
    raise MergeError(
        config_path,
        f"unsupported architecture {architectures[0]}: transformers has no such model (pass --trust-remote-code for a remote-code model)",
    )


def check_plan_against_architecture(
    plan_tensors: Iterable[PlannedTensor], expected: ExpectedTensors, config_path: Path
) -> None:
    """Every planned tensor must be one the architecture holds, with its shape, and every expected
    tensor must be planned (a tied duplicate may be left out). One ``MergeError`` lists all problems."""
    plan_tensors = list(plan_tensors)
    planned = {t.name: t.shape for t in plan_tensors}
    aliases = expected.loaded_aliases(planned)
    present = expected.present(planned, aliases)
    optional = {name for group in expected.tied_groups if group & present for name in group}
    optional |= {t.name for t in inert_absent_tensors(plan_tensors, expected)}
    optional |= {name for group in expected.all_or_none_groups if not group & present for name in group}
    unexpected = sorted(set(planned) - set(expected) - set(aliases))
    missing = sorted(set(expected) - present - optional)
    wanted = {name: expected[name] for name in planned if name in expected}
    wanted.update({name: expected.shape_of(target) for name, target in aliases.items()})
    mismatched = [
        f"{name} {planned[name]} vs {shape}" for name, shape in sorted(wanted.items()) if tuple(planned[name]) != shape
    ]
    problems = []
    for label, names in (
        ("unexpected (no such tensor in the architecture)", unexpected),
        ("missing", missing),
        ("shape mismatch (checkpoint vs config)", mismatched),
        ("pairs of names for one tensor", expected.doubles(planned, aliases)),
    ):
        if names:
            shown = ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
            problems.append(f"{len(names)} {label}: {shown}")
    if problems:
        raise MergeError(config_path, "checkpoint does not match the architecture: " + "; ".join(problems))


def inert_absent_tensors(plan_tensors: Iterable[PlannedTensor], expected: ExpectedTensors) -> list[PlannedTensor]:
    """Expected tensors the checkpoint has no key for because they cannot change the output, planned
    as zeros so that ``from_pretrained`` finds every tensor it expects (it reports a zero-element
    one as missing too).

    These are tensors with zero elements (Qwen2-MoE with ``shared_expert_intermediate_size: 0``
    has a shared expert of width 0) and the gate of such a zero-width shared expert: Megatron
    builds neither, and the gate only scales that branch's output, which is always 0.
    """
    plan_tensors = list(plan_tensors)
    planned = {t.name for t in plan_tensors}
    present = expected.present(planned, expected.loaded_aliases(planned))
    absent = {name: shape for name, shape in expected.items() if name not in present}
    inert = {name: shape for name, shape in absent.items() if math.prod(shape) == 0}
    for name, shape in absent.items():
        branch = name.removesuffix("_gate.weight") + "."
        if name.endswith(".shared_expert_gate.weight") and all(
            math.prod(s) == 0 for n, s in expected.items() if n.startswith(branch)
        ):
            inert[name] = shape
    numel = Counter()
    for t in plan_tensors:
        numel[t.dtype] += t.numel
    dtype = numel.most_common(1)[0][0] if numel else torch.float32
    return [
        PlannedTensor(name, shape, dtype, Computed(lambda shape=shape: torch.zeros(shape, dtype=dtype)))
        for name, shape in sorted(inert.items())
    ]
