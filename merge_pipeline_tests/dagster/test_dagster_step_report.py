"""``step_report`` in a real instance: an unfolded LoRA merge fails ``weights_changed``; folded, the report shows what changed."""

from __future__ import annotations

import base64

from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.dagster.helpers import CHAIN, asset, materialize
from merge_pipeline_tests.engine.test_fp8 import LLAMA  # its weights fit the scheme's groups

LORA = FsdpSpec(lora=(4, 8))
step_report = asset("step_report")
WITH_REPORT = [*CHAIN, step_report]


def report_of(result) -> tuple[dict, dict]:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == "step_report"]
    checks = {e.check_name: e for e in result.get_asset_check_evaluations() if e.asset_key == step_report.key}
    return event.materialization.metadata, checks


def test_weights_changed_fails_on_an_unfolded_lora_and_passes_folded(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(LORA)
    base = sample.reference_dir / "base"
    roots.drop(sample, "lora/global_step_1", tracker=1)
    roots.drop(sample, "lora/global_step_2", tracker=2)
    settings = roots.settings(hf_model_path=str(base))

    unfolded = materialize(instance, settings, "lora/global_step_1/actor", selection=WITH_REPORT)
    folded = materialize(
        instance, settings, "lora/global_step_2/actor", merge_config={"merge_lora": True}, selection=WITH_REPORT
    )

    assert unfolded.success and folded.success  # the merge is right either way: the report's checks do not block
    metadata, checks = report_of(unfolded)
    assert not checks["weights_changed"].passed and checks["finite"].passed
    assert checks["weights_changed"].metadata["bit-identical to"].value == "base model"
    assert "vs base model: bit-identical" in metadata["summary"].value and metadata["base model"].value == str(base)
    assert "previous step" not in metadata  # step 1 is the run's first

    metadata, checks = report_of(folded)
    assert checks["weights_changed"].passed and checks["finite"].passed
    assert checks["weights_changed"].metadata["compared with"].value == "previous step, base model"
    assert metadata["previous step"].value == str(roots.target("lora/global_step_1/actor"))
    assert 0 < metadata["largest change vs base model"].value == metadata["largest change vs previous step"].value
    assert metadata["NaN"].value == metadata["Inf"].value == 0 and metadata["tensors"].value == 27
    table = metadata["table"].value
    assert "| change vs previous step | change vs base model |" in table and "q_proj" in table
    png = base64.b64decode(metadata["plot"].value.split("base64,", 1)[1].rstrip(")"))
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000


def test_a_quantized_step_says_its_scheme_and_what_was_kept(fsdp_checkpoint, roots, instance):
    sample = fsdp_checkpoint(LLAMA)
    roots.drop(sample, "q/global_step_1", tracker=1)
    result = materialize(
        instance, roots.settings(), "q/global_step_1/actor", merge_config={"quantize": "W8A16"}, selection=WITH_REPORT
    )

    assert result.success
    metadata, _ = report_of(result)
    quantization = metadata["quantization"].value
    assert "- weights: 14 linear weights in W8A16 (compressed-tensors pack-quantized)" in quantization
    assert "- kept in bfloat16: `lm_head`, `model.embed_tokens` (and every norm and bias)" in quantization
