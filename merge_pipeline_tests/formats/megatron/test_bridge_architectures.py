"""Each architecture in ``families.MEGATRON_PROVEN`` (and each other form in ``families.BRIDGE_VARIANTS``) built through Megatron-Bridge 0.6.2 itself and saved as verl
saves it: a tiny transformers model of the architecture, loaded by the bridge's own model provider on two
gloo ranks (tensor parallel 2; expert parallel 2 where the family has experts), megatron-core's
``dist_checkpointing.save`` of its sharded state dict. The CLI merge (``--backend auto``) of those shards
equals the bridge's own ``export_hf_weights`` of the same model bit for bit, transformers loads the
merged folder with nothing missing or unexpected, and its logits on the merged folder equal its logits on the bridge's
export (the bridge's round trip) bit for bit, for every architecture but those whose transformers forward fails on
CPU (``NO_CPU_FORWARD``, each with the error it raises, which the test checks it still raises).

One ``.venv-bridge`` process writes every architecture (``merge_pipeline_samples/megatron_bridge_archs.py``,
which says what stands in for what on CPU: TransformerEngine's modules by ``merge_pipeline_samples/te_stand_in/``,
mamba-ssm's by ``merge_pipeline_samples/mamba_stand_in/``),
once per venv: the folder is cached in ``.venv-bridge/fixtures/`` under its stamp and the writer's sources."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from merge_pipeline import families
from merge_pipeline.hf.folder_checks import load_with_info
from merge_pipeline_tests.helpers import assert_bit_exact, cached_release_fixture, run_cli

pytestmark = pytest.mark.slow

LAYOUTS = {**families.MEGATRON_PROVEN, **families.BRIDGE_VARIANTS}  # fixture -> its layout
PROVEN = sorted(LAYOUTS)
WRITER = (
    "merge_pipeline_samples/megatron_bridge_archs.py",
    "merge_pipeline_samples/megatron_bridge_save.py",
    "merge_pipeline_samples/gloo_ranks.py",
    "merge_pipeline_samples/te_stand_in",
    "merge_pipeline_samples/mamba_stand_in",
)


# transformers 5.12.1's forward of these tiny models fails on CPU: the error each raises (checked, so the list cannot
# go stale).
NO_CPU_FORWARD = {
    "GlmMoeDsaForCausalLM": "The size of tensor a (4) must match the size of tensor b (8) at non-singleton dimension 1",
}
INPUT_IDS = torch.arange(8)[None]
# Built with one multi-token-prediction layer (mtp.*), as their releases are: the merge must hold it.
WITH_MTP = {f for f in families.MEGATRON_PROVEN if f.startswith(("Qwen3Next", "Qwen3_5"))}


@pytest.fixture(scope="module")
def bridge_saves() -> Path:
    """``<root>/<architecture>/{hf/, actor/model/dist_ckpt/, expected/model.safetensors}``."""
    return cached_release_fixture(".venv-bridge", "megatron_bridge_archs.py", *PROVEN, sources=WRITER, timeout=3600)


@pytest.mark.parametrize("architecture", PROVEN)
def test_merge_equals_the_bridges_export_and_gives_its_logits(capsys, tmp_path, bridge_saves, architecture):
    saved = bridge_saves / architecture
    assert not (saved / "failed.txt").exists(), (saved / "failed.txt").read_text()
    assert (saved / "layout.txt").read_text().strip() == LAYOUTS[architecture]
    role = tmp_path / "actor"
    shutil.copytree(saved / "actor" / "model" / "dist_ckpt", role / "model" / "dist_ckpt")
    code, _, err = run_cli(
        capsys,
        "merge",
        "--local_dir",
        role,
        "--target_dir",
        tmp_path / "out",
        "--backend",
        "auto",
        "--no-progress",
        "--hf_model_path",
        saved / "hf",
    )
    assert code == 0, err
    source = json.loads((tmp_path / "out" / "merge_manifest.json").read_text())["source"]
    # One .distcp per rank; at TP=1 without experts (Falcon-H1) the second rank holds only replicas: one file.
    files = 1 if LAYOUTS[architecture] == "TP=1" else 2
    assert source["backend"] == "megatron" and len(source["inputs"]) == files
    assert_bit_exact(tmp_path / "out", saved / "expected")
    if architecture in WITH_MTP:  # the merge equals the export, which holds it
        with safe_open(saved / "expected" / "model.safetensors", "pt") as expected:
            assert "mtp.fc.weight" in expected.keys()
    model_class = getattr(transformers, architecture.partition("+")[0])  # a variant: <architecture>+<variant>
    merged, info = load_with_info(model_class, tmp_path / "out")  # as the merge's own check loads the weights
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    export = tmp_path / "export"  # the bridge's export under the tiny model's config: the round trip
    shutil.copytree(saved / "expected", export)
    shutil.copy(saved / "hf" / "config.json", export)
    speakers = saved / "hf" / "spk_dict.pt"  # Qwen2.5-Omni's: its from_pretrained requires them, the merge copies them
    if speakers.exists():
        assert (tmp_path / "out" / speakers.name).read_bytes() == speakers.read_bytes()
        shutil.copy(speakers, export)
    round_trip = model_class.from_pretrained(export)
    if architecture in NO_CPU_FORWARD:
        with pytest.raises(RuntimeError, match=re.escape(NO_CPU_FORWARD[architecture])):
            _logits(merged)
        return
    assert torch.equal(_logits(merged), _logits(round_trip))


def _logits(model) -> torch.Tensor:
    model = getattr(model, "thinker", model)  # an Omni model's text comes from its thinker (it has no forward)
    with torch.no_grad():
        # Out of the files' memory maps: a CPU kernel's rounding can follow an operand's alignment, which differs
        # between two files of the same bits (seen with Gemma4ForConditionalGeneration+moe: 3e-7 apart, equal cloned).
        for param in model.parameters():
            param.data = param.data.clone()
        return model.eval()(input_ids=INPUT_IDS).logits
