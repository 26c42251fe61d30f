"""``smoke_test``: the merged folder loaded with transformers on CPU, its greedy text and loss on a fixed
text in ``step_report`` and the model card, equal to the source model's; off by default, bounded by size."""

from __future__ import annotations

import dagster as dg
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from merge_pipeline.dagster.hub_model import HuggingFaceHub
from merge_pipeline.hf.smoke_test import FIXED_TEXT, NEW_TOKENS
from merge_pipeline_tests.dagster.helpers import ACTOR, CHAIN, asset, materialize
from merge_pipeline_tests.hub.conftest import WRITER, hub  # noqa: F401 (the fake Hub fixture)

KEY = "run/global_step_1/actor"
hub_model, step_report = asset("hub_model"), asset("step_report")
PROMPT = "the trainer saves a checkpoint every few"


def report_metadata(result) -> dict:
    [event] = [e for e in result.get_asset_materialization_events() if e.asset_key == step_report.key]
    return event.materialization.metadata


def source_model_answers(sample, tokenizer_dir) -> tuple[str, float]:
    """The greedy text and fixed-text loss of the model the checkpoint was saved from (not the merge)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(sample.reference_dir, dtype="auto").eval()
    with torch.inference_mode():
        asked = tokenizer(PROMPT, return_tensors="pt")
        ids = model.generate(**asked, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        fixed = tokenizer(FIXED_TEXT, return_tensors="pt")
        loss = model(**fixed, labels=fixed["input_ids"]).loss.item()
    return tokenizer.decode(ids[0, asked["input_ids"].shape[1] :], skip_special_tokens=True), loss


def test_the_smoke_test_reports_the_source_models_text_and_loss_in_the_report_and_the_card(
    hub,  # noqa: F811
    fsdp_checkpoint,
    roots,
    instance,
):
    sample = fsdp_checkpoint(ACTOR)
    roots.drop(sample, "run/global_step_1", tracker=1)
    settings = roots.settings(smoke_test=True, smoke_prompt=PROMPT)

    result = materialize(instance, settings, KEY, selection=[*CHAIN, step_report])

    assert result.success
    metadata = report_metadata(result)
    text, loss = source_model_answers(sample, roots.target(KEY))
    assert metadata["smoke test"].value.startswith(f"passed: {NEW_TOKENS} greedy tokens on CPU in ")
    assert (metadata["smoke prompt"].value, metadata["smoke text"].value) == (PROMPT, text)
    assert metadata["smoke loss (fixed text)"].value == round(loss, 4) and loss > 0

    hub_resource = HuggingFaceHub(organization="org", token=WRITER)
    published = dg.materialize(
        [hub_model], partition_key=KEY, instance=instance, resources={"settings": settings, "hub": hub_resource}
    )
    assert published.success
    card = hub.tree("org/run-actor", "global_step_1")["README.md"].decode()
    assert "## Smoke test" in card and f'prompt:       "{PROMPT}"' in card
    assert f"Mean next-token loss on a short fixed text: {round(loss, 4):.4f}" in card


def test_the_smoke_test_is_off_by_default_and_skips_folders_over_its_size(fsdp_checkpoint, roots, instance):
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_1", tracker=1)
    roots.drop(fsdp_checkpoint(ACTOR), "run/global_step_2", tracker=2)

    default = materialize(instance, roots.settings(), KEY, selection=[*CHAIN, step_report])
    too_big = materialize(
        instance,
        roots.settings(smoke_test=True, smoke_max_size="100KB"),
        "run/global_step_2/actor",
        selection=[*CHAIN, step_report],
    )

    assert default.success and "smoke test" not in report_metadata(default)
    assert too_big.success
    assert (
        report_metadata(too_big)["smoke test"].value
        == "skipped: 794.43 KiB of weights is over smoke_max_size (97.66 KiB)"
    )
