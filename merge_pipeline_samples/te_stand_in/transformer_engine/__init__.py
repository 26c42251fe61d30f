"""A CPU stand-in for NVIDIA TransformerEngine, for ``.venv-bridge`` only (``scripts/setup_bridge.sh`` copies this
package into its site-packages): with it, megatron-core 0.18.2's TE extensions
(``megatron/core/extensions/transformer_engine.py``) and Megatron-Bridge 0.6.2's own TransformerEngine layer specs
build on CPU, so a model saved here carries the parameter names a verl run on GPUs (TransformerEngine installed)
saves: ``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``, grouped experts'
``experts.linear_fc1.weight<N>``, each TE module's ``_extra_state``.

What is stood in (``transformer_engine.pytorch``): ``Linear``, ``LayerNormLinear``, ``GroupedLinear``, ``RMSNorm``,
``LayerNorm``, ``DotProductAttention``; and, by name only, what megatron-core and the bridge import or subclass
at import time: the FP8 state (``fp8.FP8GlobalStateManager``, ``fp8_autocast``, ``fp8_model_init``: FP8 never
on), ``common.recipe`` (FP8 recipes: cannot be built), ``distributed`` (the RNG tracker, a no-op
``activation_recompute_forward``), ``tensor.QuantizedTensor`` (nothing is one), ``router`` (fused router kernels:
raise; the writer turns router fusion off), ``ops`` (fusible operations: cannot be built). ``LayerNormMLP``, TE's
permutation kernels and ``TransformerLayer`` are not stood in (the last cannot be built). Each module registers
the parameters TE's registers, under TE's names and at TE's per-rank shapes, and nothing else; a forward runs
where it is plain torch on one rank (linear, norm then linear, per-group linear, norms); no TP communication, no
FP8, no fused kernels, no attention forward.

How it was checked against TE's source (NVIDIA/TransformerEngine at d0067d0, version 2.20.0.dev0;
``transformer_engine/pytorch/``): the constructors' keyword names from ``module/linear.py``,
``module/layernorm_linear.py``, ``module/grouped_linear.py``, ``module/rmsnorm.py``, ``module/layernorm.py``,
``attention/dot_product_attention/dot_product_attention.py``; the parameter names and shapes from their
``register_parameter`` calls: ``weight`` ``(out_features / tp, in_features)`` in column mode and
``(out_features, in_features / tp)`` in row mode, ``bias`` (an empty plain tensor, not a parameter, when
``bias=False``), ``layer_norm_weight`` / ``layer_norm_bias`` (the latter only for LayerNorm) of the unsplit input,
``weight{i}`` / ``bias{i}`` per GEMM, ``softmax_offset`` (heads / tp) for a learnable softmax; ``_extra_state``
from ``module/base.py``'s ``get_extra_state``: an empty uint8 tensor when no FP8 recipe ran. The stand-in copies no
TE code. The names megatron-core then saves were checked by saving through it and reading the shards back
(``merge_pipeline_tests/formats/megatron/test_bridge_architectures.py``).
"""

__version__ = "2.8.0"  # the first TE release whose attention takes a learnable softmax (gpt-oss sinks)

from transformer_engine import common, pytorch  # noqa: E402,F401
