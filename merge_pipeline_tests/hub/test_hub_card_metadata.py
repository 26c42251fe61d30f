"""The model card's metadata as the Hub client reads it back from the test Hub: each base model relation
(finetune, adapter, merge, quantized) places the folder under its base, with the base's license and the
architecture's task; a local path is never published as a base model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from huggingface_hub import ModelCard, hf_hub_download

from merge_pipeline.hf.manifest import MANIFEST
from merge_pipeline.hub.upload import upload_folder_verified
from merge_pipeline.options import MergeOptions
from merge_pipeline.pipeline.merge import merge
from merge_pipeline_samples.fsdp import FsdpSpec
from merge_pipeline_tests.hub.conftest import WRITER
from merge_pipeline_tests.hub.test_hub_upload import FAST

BASE_ID = "Qwen/Qwen2.5-0.5B"  # what the trainer loaded: a Hub id
TRACKED = ("base_model", "base_model_relation", "library_name", "license", "license_name", "license_link")


def published(hub, folder: Path, repo_id: str) -> dict:
    """Upload ``folder``; its card's metadata as huggingface_hub reads it from the Hub."""
    upload_folder_verified(folder, repo_id, retry=FAST)
    readme = hf_hub_download(
        repo_id, "README.md", endpoint=hub.endpoint, token=WRITER, local_dir=folder.parent / repo_id
    )
    data = ModelCard.load(readme).data.to_dict()
    return {k: data.get(k) for k in (*TRACKED, "pipeline_tag")}


def step(sample, root: Path, number: int, *, recorded: str | None = None) -> Path:
    """The sample as ``run/global_step_<number>/actor``; ``recorded``: the config's ``_name_or_path`` (what
    transformers records of the model path the trainer loaded)."""
    role_dir = root / "run" / f"global_step_{number}" / sample.role_dir.name
    shutil.copytree(sample.role_dir, role_dir)
    if recorded is not None:
        config = role_dir / "huggingface" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "_name_or_path": recorded}))
    return role_dir


def base_folder(sample, where: Path, *, name_or_path: str | None, readme: str | None) -> Path:
    """A base model folder as --hf_model_path names it: its config (the checkpoint's own), its README."""
    where.mkdir(parents=True)
    config = json.loads((sample.role_dir / "huggingface" / "config.json").read_text())
    if name_or_path is not None:
        config["_name_or_path"] = name_or_path
    (where / "config.json").write_text(json.dumps(config))
    if readme is not None:
        (where / "README.md").write_text(readme)
    return where


def merged(role_dir: Path, target: Path, **options) -> Path:
    return merge(role_dir, target, MergeOptions(backend="fsdp", **options), show_progress=False).target_dir


def test_finetune_names_the_base_from_hf_model_path_and_carries_its_license(hub, fsdp_checkpoint, tmp_path):
    sample = fsdp_checkpoint(FsdpSpec())
    base = base_folder(
        sample, tmp_path / "base", name_or_path=BASE_ID, readme="---\nlicense: apache-2.0\n---\n# Qwen2.5\n"
    )
    folder = merged(step(sample, tmp_path, 3), tmp_path / "out", hf_model_path=str(base))

    assert published(hub, folder, "org/finetuned") == {
        "base_model": BASE_ID,
        "base_model_relation": "finetune",
        "library_name": "transformers",
        "license": "apache-2.0",
        "license_name": None,
        "license_link": None,
        "pipeline_tag": "text-generation",
    }


def test_an_unfolded_lora_is_an_adapter_of_the_base_a_hub_cache_folder_names(hub, fsdp_checkpoint, tmp_path):
    sample = fsdp_checkpoint(FsdpSpec(lora=(4, 8)))
    snapshot = tmp_path / "hub_cache" / "models--meta-llama--Llama-3.2-1B" / "snapshots" / "0123abcd"
    readme = "---\nlicense: other\nlicense_name: llama3.2\nlicense_link: LICENSE.txt\n---\n"
    base = base_folder(sample, snapshot, name_or_path=None, readme=readme)
    folder = merged(step(sample, tmp_path, 3), tmp_path / "out", hf_model_path=str(base))
    assert (folder / "lora_adapter" / "adapter_config.json").is_file()

    assert published(hub, folder, "org/adapter") == {
        "base_model": "meta-llama/Llama-3.2-1B",
        "base_model_relation": "adapter",
        "library_name": "peft",
        "license": "other",
        "license_name": "llama3.2",
        "license_link": "LICENSE.txt",
        "pipeline_tag": "text-generation",
    }


def test_an_average_is_a_merge_of_the_base_the_trainer_recorded(hub, fsdp_checkpoint, tmp_path):
    sample = fsdp_checkpoint(FsdpSpec())
    steps = [merged(step(sample, tmp_path, n, recorded=BASE_ID), tmp_path / f"out{n}") for n in (3, 4)]
    average = merged(steps[-1], tmp_path / "average", average_inputs=tuple(map(str, steps)), average_weights=(0.5, 0.5))

    assert published(hub, average, "org/averaged") == {
        "base_model": BASE_ID,
        "base_model_relation": "merge",
        "library_name": "transformers",
        "license": None,  # no base folder given: no README to read it from
        "license_name": None,
        "license_link": None,
        "pipeline_tag": "text-generation",
    }


def test_a_quantized_merge_is_a_finetune_of_its_base(hub, fsdp_checkpoint, tmp_path):
    """The Hub's ``quantized`` is the base's own weights in fewer bits; a merge's weights are a training step's,
    whatever its manifest's quantization says (an earlier manifest field, ``base_only``, included)."""
    sample = fsdp_checkpoint(FsdpSpec())
    folder = merged(step(sample, tmp_path, 3, recorded=BASE_ID), tmp_path / "out")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["decisions"]["quantization"] = {
        **{"scheme": "W8A16", "format": "pack-quantized", "quantized_weights": 14, "ignore": ["lm_head"]},
        **{"off_grid": [], "base_only": True},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))

    card = published(hub, folder, "org/quantized")
    assert (card["base_model"], card["base_model_relation"]) == (BASE_ID, "finetune")


def test_a_local_path_is_never_published_as_the_base_model(hub, fsdp_checkpoint, tmp_path, monkeypatch):
    """Neither an absolute path nor an org/name-shaped one that is a folder here; no base, then no relation."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "qwen").mkdir(parents=True)  # "models/qwen" looks like a Hub id, but is this folder
    critic = fsdp_checkpoint(FsdpSpec(arch="llama", critic=True))
    base = base_folder(critic, tmp_path / "base", name_or_path=str(tmp_path / "base"), readme=None)
    folder = merged(step(critic, tmp_path, 3, recorded="models/qwen"), tmp_path / "out", hf_model_path=str(base))

    assert published(hub, folder, "org/critic") == {
        "base_model": None,
        "base_model_relation": None,
        "library_name": "transformers",
        "license": None,
        "license_name": None,
        "license_link": None,
        "pipeline_tag": "token-classification",  # a value model
    }
