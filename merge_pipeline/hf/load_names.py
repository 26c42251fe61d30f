"""Which in-memory tensor a checkpoint name loads into, as ``from_pretrained`` renames it.

transformers 5 derives the names it saves by reversing the renamings it applies on load. For most
models that reversal is the inverse, but not always: kimi_k25 loads the Hub's
``language_model.model.layers.N`` (and ``mm_projector.*`` through the base-model prefix), while
reversing its ``blocks`` -> ``layers`` renaming everywhere saves ``language_model.model.blocks.N``. A
genuine checkpoint's name is therefore also right when loading puts it, one to one, into a parameter
of the same shape; or, for a name a fusing converter takes (MoE experts), when loading's renamings
make it the same name as exactly one saved name the reversal gives (then it stands for that one).
"""

from __future__ import annotations

from collections.abc import Iterable
from copy import deepcopy

from transformers.core_model_loading import (
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)


class LoadNames:
    """The load-time renaming of one model, and which saved names each of its tensors comes back as."""

    def __init__(self, model, memory: dict[str, tuple[int, ...]], saved_names: Iterable[str]):
        from transformers.conversion_mapping import get_model_conversion_mapping

        # As revert_weight_conversion: a model built from its config drops prefix changes.
        transforms = [
            t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)
        ]
        self.memory = memory
        self.prefix = model.base_model_prefix
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        # Saved name -> the memory tensors whose reversal names it (several for a fused q/k/v).
        reverse = [t.reverse_transform() for t in transforms[::-1]]
        renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
        converters = [t for t in reverse if isinstance(t, WeightConverter)]
        saved_names = set(saved_names)
        self._renamed_saved: dict[str, list[str]] = {}
        for name, renamed in self._renamed(saved_names).items():
            self._renamed_saved.setdefault(renamed, []).append(name)
        self.sources: dict[str, set[str]] = {}
        for name in sorted(memory, key=dot_natural_key):  # group renamings are stateful: loading's order
            saved, _ = rename_source_key(name, renamings, converters, reverse=True)
            if saved in saved_names:
                self.sources.setdefault(saved, set()).add(name)
        # In-memory tensor -> the one saved name the reversal gives it alone.
        self.saved_name = {next(iter(m)): saved for saved, m in self.sources.items() if len(m) == 1}

    def aliases(self, names: Iterable[str]) -> dict[str, str]:
        """Each name loading treats as a tensor of the model (in-memory name) or as one saved name -> that name."""
        renamings = deepcopy(self._renamings)
        names = sorted(names, key=dot_natural_key)
        renamed_only = self._renamed(names)
        aliases = {}
        for name in names:
            renamed, converted = rename_source_key(name, renamings, self._converters, self.prefix, self.memory)
            if renamed not in self.memory and name in self.memory:  # as from_pretrained: the name itself
                renamed, converted = rename_source_key(name, [], [], self.prefix, self.memory)
            if converted is None and renamed in self.memory:
                aliases[name] = renamed
            elif converted is not None and len(saved := self._renamed_saved.get(renamed_only[name], [])) == 1:
                aliases[name] = saved[0]
        return aliases

    def _renamed(self, names: Iterable[str]) -> dict[str, str]:
        """Each name after loading's renamings alone, taken in loading's order with fresh renamings."""
        renamings = deepcopy(self._renamings)
        return {name: rename_source_key(name, renamings, [])[0] for name in sorted(names, key=dot_natural_key)}

    def covered(self, loaded: Iterable[str]) -> set[str]:
        """The saved names all of whose memory tensors are among ``loaded``."""
        loaded = set(loaded)
        return {saved for saved, sources in self.sources.items() if sources <= loaded}
