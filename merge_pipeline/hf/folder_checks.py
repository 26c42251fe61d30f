"""Checks of a published HF folder, as plain functions: each returns the problems it found (none = pass)."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import transformers
from transformers.utils import logging as hf_logging

from merge_pipeline.errors import MergeError
from merge_pipeline.hf.architecture import model_class, multi_token_prediction_prefixes
from merge_pipeline.hf.config import CONFIG
from merge_pipeline.hf.file_names import INDEX, SINGLE_FILE
from merge_pipeline.hf.fp8 import SCALE_SUFFIX
from merge_pipeline.hf.lora import ADAPTER_CONFIG, ADAPTER_FILE, PEFT_PREFIX
from merge_pipeline.hf.manifest import digests_still_valid, file_sums, read_manifest
from merge_pipeline.hf.quantization import zero_point_packing
from merge_pipeline.hf.safetensors import TORCH_DTYPES, exact_common_dtype, read_header

_ADAPTER_TENSOR = re.compile(rf"^{re.escape(PEFT_PREFIX)}.+\.(?P<module>[^.]+)\.lora_(?P<which>[AB])\.weight$")


def weight_files(folder: Path) -> dict[str, dict[str, dict]]:
    """file name -> its tensor entries, for the model weights (not a LoRA adapter's)."""
    return {p.name: read_header(p) for p in sorted(folder.glob("model*.safetensors"))}


def is_adapter_folder(folder: Path) -> bool:
    """A PEFT adapter alone (a LoRA-only checkpoint merged without its base model): no config.json."""
    return (folder / ADAPTER_CONFIG).is_file() and not (folder / CONFIG).is_file()


def meta_load_problems(folder: Path) -> list[str]:
    """Build the model class config.json names on the meta device from the folder: every weight must load as stored."""
    if is_adapter_folder(folder):
        return adapter_problems(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    try:
        # The class the merge checked the plan against: the value-model head is in config.json by now.
        model_type = model_class(config, folder / CONFIG, value_model=False, trust_remote_code=False)
    except MergeError as exc:
        return [exc.problem]
    architecture = model_type.__name__
    with _quiet_transformers():  # what it would report (a load report table, a progress bar), problems says
        # use_kernels=False: transformers 5.25 would otherwise fetch Hub kernels and refuse the meta device.
        # PreTrainedModel's loader: what a class's own from_pretrained adds after it is no weight (Qwen2.5-Omni's
        # speakers), and Qwen2.5-Omni's breaks on output_loading_info ('tuple' object has no attribute 'load_speakers').
        with _one_process(config):
            model, info = load_with_info(
                model_type, folder, device_map="meta", dtype="auto", use_kernels=False, ignore_mismatched_sizes=True
            )
    expected = model.state_dict()
    problems = [f"missing from the weights: {k}" for k in sorted(info["missing_keys"])]
    mtp = multi_token_prediction_prefixes(config)  # kept for vLLM / SGLang; transformers builds none
    problems += [f"not in {architecture}: {k}" for k in sorted(info["unexpected_keys"]) if not k.startswith(mtp)]
    # The one shape transformers may build differently from a stored one: packed zero points (built unpacked).
    quantization = getattr(config, "quantization_config", None)
    packing = zero_point_packing(quantization) if isinstance(quantization, dict) else None
    packed = {k for k, stored, built in info["mismatched_keys"] if _packed(k, built, packing) == tuple(stored)}
    problems += [
        f"{key}: stored as {list(stored)}, {architecture} has {list(built)}"
        for key, stored, built in sorted(info["mismatched_keys"])
        if key not in packed
    ]
    stored = {n: e for tensors in weight_files(folder).values() for n, e in tensors.items()}
    for name, entry in sorted(stored.items()):
        quantized = name + SCALE_SUFFIX in stored  # an FP8 weight with its scales: loads dequantized without a GPU
        if (
            name in expected
            and not quantized
            and name not in packed
            and not _loads_unaltered(TORCH_DTYPES[entry["dtype"]], expected[name].dtype)
        ):
            problems.append(f"{name}: stored as {entry['dtype']}, loads as {expected[name].dtype}")
    return problems


def _packed(key: str, shape: tuple[int, ...], packing: int | None) -> tuple[int, ...] | None:
    """The shape of zero points ``key`` as compressed-tensors packs them (rows rounded up to a whole int32)."""
    if packing is None or not key.endswith(".weight_zero_point"):
        return None
    return (-(-shape[0] // packing), *shape[1:])


def _one_process(config) -> contextlib.AbstractContextManager:
    """compressed-tensors compresses a model's modules across the ranks of an initialized process group (a
    torchrun merge's), waiting for the others: the checks run on the lead alone, so it works as one process."""
    quantization = getattr(config, "quantization_config", None) or {}
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "compressed-tensors":
        return contextlib.nullcontext()
    from compressed_tensors.offload.utils import as_single_threaded

    return as_single_threaded()


def load_with_info(model_type: type, folder: Path, **kwargs) -> tuple[torch.nn.Module, dict]:
    """``model_type`` loaded from ``folder`` by PreTrainedModel's own ``from_pretrained``, with its loading info."""
    return transformers.PreTrainedModel.from_pretrained.__func__(model_type, folder, output_loading_info=True, **kwargs)


def _loads_unaltered(stored: torch.dtype, loaded: torch.dtype) -> bool:
    """Loaded as stored, or widened without changing a value (bf16 weights in a float32 model)."""
    if stored == loaded:
        return True
    return stored.is_floating_point and loaded.is_floating_point and exact_common_dtype(stored, loaded) == loaded


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def adapter_problems(folder: Path) -> list[str]:
    """Without the base model PEFT cannot load the adapter here; check what it will read: a LoRA
    config, and only lora_A / lora_B tensors of its target modules with its rank."""
    from peft import LoraConfig

    config = LoraConfig.from_pretrained(folder)
    tensors = read_header(folder / ADAPTER_FILE)
    problems = [] if tensors else [f"{ADAPTER_FILE} holds no tensors"]
    for name, entry in sorted(tensors.items()):
        match = _ADAPTER_TENSOR.match(name)
        if not match or match["module"] not in set(config.target_modules or ()):
            problems.append(f"not a LoRA tensor of a target module in {ADAPTER_CONFIG}: {name}")
            continue
        rank = entry["shape"][0] if match["which"] == "A" else entry["shape"][-1]
        if rank != config.r:
            problems.append(f"{name}: rank {rank}, but {ADAPTER_CONFIG} says r={config.r}")
    return problems


def index_problems(folder: Path) -> list[str]:
    """The index names every stored tensor, in the file that holds it, with the right total size."""
    if is_adapter_folder(folder):
        return []  # one adapter_model.safetensors, never sharded
    files = weight_files(folder)
    if not (folder / INDEX).is_file():
        return (
            []
            if list(files) == [SINGLE_FILE]
            else [f"no {INDEX}, and the weights are {sorted(files)} rather than one {SINGLE_FILE}"]
        )
    index = json.loads((folder / INDEX).read_text())
    stored = {name: file for file, tensors in files.items() for name in tensors}
    weight_map = index["weight_map"]
    problems = [
        f"index maps {n} to {f}, which does not hold it" for n, f in sorted(weight_map.items()) if stored.get(n) != f
    ]
    problems += [
        f"{f} holds {n}, which the index does not map" for n, f in sorted(stored.items()) if n not in weight_map
    ]
    problems += [f"{f} is not referenced by the index" for f in sorted(set(files) - set(weight_map.values()))]
    total = sum(e["nbytes"] for tensors in files.values() for e in tensors.values())
    if index["metadata"]["total_size"] != total:
        problems.append(f"index total_size {index['metadata']['total_size']} != {total} bytes of tensor data")
    return problems


def manifest_problems(folder: Path, written: Mapping[str, Mapping] | None = None) -> list[str]:
    """Every file the manifest lists is there with its size and sha256, and no other file is.

    ``written``: the write report's entries (relative path -> entry) of the merge that made the folder.
    A file still the one its entry hashed (``digests_still_valid``) is compared by that digest, so a
    merge never hashes a weight byte twice; every other file (side files, index, configs, a weight file
    touched since) is hashed here. Without ``written`` (a folder on its own) every file is hashed."""
    recorded = read_manifest(folder)["files"]
    actual = file_sums(folder, digests_still_valid(folder, written or {}))
    problems = [f"{name}: in the manifest, not in the folder" for name in sorted(set(recorded) - set(actual))]
    problems += [f"{name}: in the folder, not in the manifest" for name in sorted(set(actual) - set(recorded))]
    problems += [
        f"{name}: sha256 or size differs from the manifest"
        for name in sorted(set(actual) & set(recorded))
        if actual[name] != recorded[name]
    ]
    return problems
