"""TE's fusible operations (``te.pytorch.ops``) by name only: megatron-core's op-fuser MLP and the bridge's fused
LoRA name them in annotations and ``isinstance`` checks; building one (``use_te_op_fuser``) is not stood in."""


class FusibleOperation:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError(f"the TransformerEngine stand-in has no fusible op {type(self).__name__}")


_NAMES = (
    "AddExtraInput AllReduce BasicLinear Bias ConstantScale Dropout GEGLU GELU GroupedLinear LayerNorm Linear "
    "MakeExtraOutput Quantize RMSNorm ReGLU ReLU ReduceScatter ScaledClampedQGeGLU ScaledSReLU ScaledSwiGLU "
    "Sequential SiLU SwiGLU"
)
globals().update({name: type(name, (FusibleOperation,), {}) for name in _NAMES.split()})
