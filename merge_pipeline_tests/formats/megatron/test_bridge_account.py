"""Every architecture Megatron-Bridge registers (``merge_pipeline/bridge_mappings.json``, generated from the
installed bridge) is accounted for: merged and proven against the bridge's own export
(``families.MEGATRON_PROVEN``, with its fixture's layout), or refused with the exact reason (``families.MEGATRON_REFUSED``), which the refusal message and docs/LAYOUTS.md say."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge_pipeline import families
from merge_pipeline.errors import MergeError
from merge_pipeline.formats.megatron import bridge_table
from merge_pipeline.formats.megatron.names import megatron_family

LAYOUTS = Path(__file__).resolve().parents[3] / "docs" / "LAYOUTS.md"
REGISTERED = bridge_table.architectures()


def _mapped(architecture: str) -> bool:
    """The Megatron reader maps it: a family record's names, or Megatron-Bridge's table for a proven one."""
    try:
        megatron_family({"architectures": [architecture]}, Path("config.json"))
    except MergeError:
        return False
    return True


@pytest.mark.parametrize("architecture", REGISTERED)
def test_registered_architecture_is_accounted_for(architecture):
    accounts = [
        architecture in families.MEGATRON_PROVEN,
        architecture in families.MEGATRON_REFUSED,
    ]
    assert accounts.count(True) == 1, (architecture, accounts)
    if architecture in families.MEGATRON_REFUSED:
        with pytest.raises(MergeError) as refused:
            megatron_family({"architectures": [architecture]}, Path("config.json"))
        assert families.MEGATRON_REFUSED[architecture] in str(refused.value)
    else:
        assert _mapped(architecture), f"{architecture} is counted as merged but no Megatron family maps it"


def test_layouts_md_has_a_row_per_registered_architecture():
    text = LAYOUTS.read_text()
    for architecture in REGISTERED:
        said = families.MEGATRON_PROVEN.get(architecture) or families.MEGATRON_REFUSED[architecture]
        rows = [line for line in text.splitlines() if line.startswith(f"| `{architecture}` |")]
        assert any(said in row for row in rows), f"docs/LAYOUTS.md: no row for {architecture} saying {said!r}"


def test_accounts_name_only_registered_or_known_architectures():
    for architecture in families.MEGATRON_PROVEN:
        assert architecture in REGISTERED, architecture
    for variant in families.BRIDGE_VARIANTS:  # another form of a proven architecture
        assert variant.partition("+")[0] in families.MEGATRON_PROVEN, variant
