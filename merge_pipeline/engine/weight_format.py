"""The format ``options`` write the model's weights in, decided in one place for the merge, the average and
``inspect``: as planned (the cast), FP8 blocks (``--dtype fp8``), a compressed-tensors preset (``--quantize``),
or the base model's own (``--quantize as-base``: its compressed-tensors group or gpt-oss's MXFP4).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from merge_pipeline.engine.as_base import base_quantization, base_scheme, follows_base
from merge_pipeline.engine.fp8_quantize import fp8_quantizer
from merge_pipeline.engine.mxfp4_quantize import mxfp4_quantizer
from merge_pipeline.engine.outputs import OutputPlan, Quantized, quantized_shards
from merge_pipeline.engine.quantize import scheme_quantizer
from merge_pipeline.errors import MergeError
from merge_pipeline.hf.config import ModelConfig
from merge_pipeline.hf.fp8 import KEPT_DTYPE
from merge_pipeline.options import MergeOptions
from merge_pipeline.plan import PlannedTensor


def formatted_outputs(outputs: OutputPlan, options: MergeOptions, config: ModelConfig, where: Path) -> OutputPlan:
    """``outputs`` in the format ``options`` (resolved by ``following_base``: an FP8 base is ``--dtype fp8``
    by then) ask for: the quantized weights each followed by their parameters, the rest bfloat16; ``where`` is
    named by a refusal."""
    fp8 = options.dtype == "fp8"
    if not fp8 and not options.quantize:
        return outputs
    if outputs.adapter is not None:
        raise MergeError(
            where,
            f"{'--dtype fp8' if fp8 else '--quantize'} quantizes base weights that a separate LoRA adapter cannot be"
            " applied to: add --merge-lora",
        )
    model = [t for shard in outputs.shards for t in shard.tensors]
    decisions, quantized = _quantizer([t.planned for t in model], options, config, where)
    formatted = replace(
        outputs, shards=quantized_shards(model, quantized, KEPT_DTYPE, options.max_shard_size), config_dtype=KEPT_DTYPE
    )
    return replace(formatted, fp8=decisions) if fp8 else replace(formatted, quantization=decisions)


def _quantizer(
    model: list[PlannedTensor], options: MergeOptions, config: ModelConfig, where: Path
) -> tuple[object, Quantized]:
    """The format's decisions on ``model`` and the writer of each weight it quantizes."""
    if options.dtype == "fp8":
        return fp8_quantizer(model, options.fp8_block_size, where)
    if not follows_base(options):
        return scheme_quantizer(model, options.quantize, options.quantize_ignore, where)
    path, base = base_quantization(options, config)
    if base.get("quant_method") == "mxfp4":
        return mxfp4_quantizer(model, base, where)
    name, scheme = base_scheme(base, path)
    return scheme_quantizer(model, name, options.quantize_ignore or tuple(base.get("ignore") or ()), where, scheme)
