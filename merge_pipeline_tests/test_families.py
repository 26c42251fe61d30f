"""The family records (``merge_pipeline/families.py``): each lookup finds exactly one record."""

from __future__ import annotations

from collections import Counter

from merge_pipeline import families


def test_each_architecture_and_model_type_names_one_family():
    architectures = Counter(a for f in families.FAMILIES.values() for a in f.architectures)
    model_types = Counter(f.model_type for f in families.FAMILIES.values())
    assert [a for a, n in architectures.items() if n > 1] == []
    assert [m for m, n in model_types.items() if n > 1] == []
    for name, family in families.FAMILIES.items():
        assert family.name == name
        assert families.by_model_type(family.model_type) is family
        assert all(families.by_architecture(a) is family for a in family.architectures)


def test_a_torchtitan_name_has_one_meaning():
    """A stored name is renamed, split per expert, transposed per expert or fused with others: never two
    of these."""
    for family in families.FAMILIES.values():
        names = family.torchtitan
        if names is None:
            continue
        fused = [part for parts in (*names.fused_layer.values(), *names.fused_vision.values()) for part in parts]
        kinds = [
            *names.layer,
            *names.grouped_experts,
            *names.transposed_experts,
            *fused,
            *names.vision,
        ]
        assert [k for k, n in Counter(kinds).items() if n > 1] == [], family.name
