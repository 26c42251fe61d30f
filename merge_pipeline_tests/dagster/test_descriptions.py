"""The UI's descriptions keep no hand-made list of training stacks: such a list went stale (the sensor's
left out Megatron-LM's ``iter_<N>``). The stacks come from the readers' step-folder declarations, on the
events the sensor records (their key's writer, ``test_sensor_stacks``); loading the location cannot ask the
readers (torch)."""

from __future__ import annotations

import dagster as dg

from merge_pipeline.dagster.averaged_model import Averaging
from merge_pipeline.dagster.component import HubPublishing, MergeCheckpoints
from merge_pipeline.dagster.instance_names import Names
from merge_pipeline.formats import step_folders
from merge_pipeline_tests.dagster.helpers import LOCATION

FIRST_LINE = 60  # `dg list defs` at 80 columns: the table's name column and borders take the rest


def descriptions(defs: dg.Definitions) -> dict[str, str]:
    """Every description the UI shows: assets, sensors, schedules, jobs and the resources' fields."""
    shown = {s.name: s.description for s in [*defs.sensors, *defs.schedules]}
    for definition in defs.assets:
        for spec in definition.specs if isinstance(definition, dg.AssetsDefinition) else [definition]:
            shown[spec.key.to_user_string()] = spec.description
    for job in defs.resolve_all_job_defs():
        shown[job.name] = job.description
    for name, resource in defs.resources.items():
        shown |= {f"{name}.{f}": field.description for f, field in type(resource).model_fields.items()}
    return {name: text for name, text in shown.items() if text}


def test_no_description_lists_a_stack_by_hand():
    stacks = {folder.stack for folder in step_folders()} - {"the HF Trainer"}  # "HF" is in many a line
    prefixes = {folder.prefix for folder in step_folders()}

    shown = descriptions(LOCATION)

    assert {"new_checkpoint_sensor", "checkpoint", "hub.revisions"} <= set(shown)
    named = {name: [w for w in (*stacks, *(f"{p}<" for p in prefixes)) if w in text] for name, text in shown.items()}
    assert {name: words for name, words in named.items() if words} == {}


def test_every_description_says_what_it_is_in_its_first_60_characters():
    """The first line of each asset's, check's, job's, sensor's, schedule's and the component's description:
    what `dg list defs` and the UI's lists show; the rest follows on the lines after."""
    everything = MergeCheckpoints(
        checkpoint_roots=["/checkpoints"],
        output_root="/merged",
        averaging=Averaging(last_k=3),
        hub=HubPublishing(organization="org"),
    ).definitions(Names("c"))
    shown = {"MergeCheckpoints": MergeCheckpoints.__doc__}
    for defs in (LOCATION, everything):
        shown |= {s.name: s.description for s in [*defs.sensors, *defs.schedules]}
        shown |= {j.name: j.description for j in defs.resolve_all_job_defs() if j.description}
        for definition in defs.assets:
            specs = definition.specs if isinstance(definition, dg.AssetsDefinition) else [definition]
            shown |= {spec.key.to_user_string(): spec.description for spec in specs}
            if isinstance(definition, dg.AssetsDefinition):
                shown |= {check.key.to_user_string(): check.description for check in definition.check_specs}

    assert {"c/hub_averaged_model", "c/step_report:finite", "c__average_run", "MergeCheckpoints"} <= set(shown)
    first_lines = {name: text.strip().splitlines()[0] if text else "" for name, text in shown.items()}
    assert {name: line for name, line in first_lines.items() if not 0 < len(line) <= FIRST_LINE} == {}
