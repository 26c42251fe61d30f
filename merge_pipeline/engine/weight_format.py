"""The format ``options`` write the model's weights in, decided in one place for the merge, the average and
``inspect``: as planned (the cast), FP8 blocks (``--dtype fp8``), a compressed-tensors preset (``--quantize``),
or the base model's own (``--quantize as-base``: its compressed-tensors group or gpt-oss's MXFP4).
"""

from __future__ import annotations

from pathlib import Path

from merge_pipeline.engine.as_base import base_quantization, base_scheme, follows_base
from merge_pipeline.engine.fp8_quantize import fp8_outputs
from merge_pipeline.engine.mxfp4_quantize import mxfp4_outputs
from merge_pipeline.engine.outputs import OutputPlan
from merge_pipeline.engine.quantize import quantized_outputs
from merge_pipeline.hf.config import ModelConfig
from merge_pipeline.options import MergeOptions


def formatted_outputs(outputs: OutputPlan, options: MergeOptions, config: ModelConfig, where: Path) -> OutputPlan:
    """``outputs`` in the format ``options`` (resolved by ``following_base``: an FP8 base is ``--dtype fp8``
    by then) ask for; ``where`` is named by a refusal."""
    if options.dtype == "fp8":
        return fp8_outputs(outputs, options.fp8_block_size, options.max_shard_size, where)
    if not options.quantize:
        return outputs
    if not follows_base(options):
        return quantized_outputs(outputs, options.quantize, options.quantize_ignore, options.max_shard_size, where)
    path, base = base_quantization(options, config)
    if base.get("quant_method") == "mxfp4":
        return mxfp4_outputs(outputs, base, options.max_shard_size, where)
    name, scheme = base_scheme(base, path)
    ignore = options.quantize_ignore or tuple(base.get("ignore") or ())
    return quantized_outputs(outputs, name, ignore, options.max_shard_size, where, scheme)
