"""TransformerEngine's PyTorch modules as megatron-core builds and saves them, on CPU (see the package's docstring)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformer_engine.pytorch import distributed, ops  # noqa: F401  (megatron-core subclasses or names them)
from transformer_engine.pytorch.fp8 import fp8_autocast, fp8_model_init  # noqa: F401  (TE's own exports)


class _TEModule(torch.nn.Module):
    """TE's ``TransformerEngineBaseModule``: every module's ``_extra_state`` is its FP8 metadata, empty without FP8."""

    def __init__(self) -> None:
        super().__init__()
        # The FP8 state TE's base module starts with (megatron-core's grouped linear reads it when saving).
        self.fp8 = self.fp8_calibration = self.fp8_initialized = False
        self.fp8_meta = {"fp8_checkpoint": False}
        self.tp_group, self.tp_size, self.sequence_parallel = None, 1, False

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        pass


def _split(features: int, tp_size: int) -> int:
    if features % tp_size:
        raise ValueError(f"{features} features do not split over {tp_size} tensor-parallel ranks")
    return features // tp_size


def _parameter(shape, dtype, init_method=None, value: float | None = None) -> torch.nn.Parameter:
    tensor = torch.empty(shape, dtype=dtype)
    if value is not None:
        tensor.fill_(value)
    elif init_method is not None:
        init_method(tensor)
    else:
        torch.nn.init.normal_(tensor, std=0.02)
    return torch.nn.Parameter(tensor)


class _ParallelLinear(_TEModule):
    """The per-rank features of TE's ``parallel_mode``: column splits the output, row the input."""

    def _local_features(self, in_features, out_features, tp_size, parallel_mode):
        self.parallel_mode = parallel_mode
        self.tp_size = tp_size
        if parallel_mode == "column":
            out_features = _split(out_features, tp_size)
        elif parallel_mode == "row":
            in_features = _split(in_features, tp_size)
        self.in_features, self.out_features = in_features, out_features

    def _weight_and_bias(self, bias: bool, params_dtype, init_method) -> None:
        self.use_bias = bias
        self.weight = _parameter((self.out_features, self.in_features), params_dtype, init_method)
        if bias:
            self.bias = _parameter((self.out_features,), params_dtype, value=0.0)
        else:  # TE keeps an empty plain tensor: no parameter, nothing saved
            self.bias = torch.Tensor().to(dtype=params_dtype)

    def _linear(self, x):
        out = F.linear(x, self.weight, self.bias if self.use_bias and not self.return_bias else None)
        return (out, self.bias) if self.return_bias else out


class Linear(_ParallelLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        init_method=None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        parameters_split=None,
        sequence_parallel: bool = False,
        **kwargs,  # TE's communication, FP8 and device options: nothing to stand in on CPU
    ) -> None:
        super().__init__()
        if parameters_split:
            raise NotImplementedError("the TransformerEngine stand-in does not split Linear's parameters")
        self.return_bias = return_bias
        self.sequence_parallel = sequence_parallel
        self._local_features(in_features, out_features, tp_size, parallel_mode)
        self._weight_and_bias(bias, params_dtype or torch.get_default_dtype(), init_method)

    def forward(self, x, is_first_microbatch=None, **kwargs):
        return self._linear(x)


def _norm(x, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool):
    gamma = weight + 1 if zero_centered_gamma else weight
    if normalization == "RMSNorm":
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * gamma
    return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)


class LayerNormLinear(_ParallelLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        eps: float = 1e-5,
        *,
        tp_size: int = 1,
        init_method=None,
        bias: bool = True,
        normalization: str = "LayerNorm",
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        return_layernorm_output: bool = False,
        parameters_split=None,
        zero_centered_gamma: bool = False,
        sequence_parallel: bool = False,
        **kwargs,
    ) -> None:
        super().__init__()
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"Unsupported normalization type: {normalization}")
        if parameters_split or return_layernorm_output:
            raise NotImplementedError("the TransformerEngine stand-in does not split or return the layer norm")
        params_dtype = params_dtype or torch.get_default_dtype()
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_bias = return_bias
        self.sequence_parallel = sequence_parallel
        self.return_layernorm_output = False
        # The norm is of the whole input (before any split), registered first as TE does.
        self.layer_norm_weight = _parameter((in_features,), params_dtype, value=float(not zero_centered_gamma))
        if normalization == "LayerNorm":
            self.layer_norm_bias = _parameter((in_features,), params_dtype, value=0.0)
        else:
            self.layer_norm_bias = None
        self._local_features(in_features, out_features, tp_size, parallel_mode)
        self._weight_and_bias(bias, params_dtype, init_method)

    def forward(self, x, is_first_microbatch=None, **kwargs):
        normed = _norm(
            x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization, self.zero_centered_gamma
        )
        return self._linear(normed)


class GroupedLinear(_ParallelLinear):
    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        tp_size: int = 1,
        init_method=None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype=None,
        parallel_mode=None,
        sequence_parallel: bool = False,
        **kwargs,
    ) -> None:
        super().__init__()
        params_dtype = params_dtype or torch.get_default_dtype()
        self.num_gemms = num_gemms
        self.use_bias = bias
        self.return_bias = return_bias
        self.sequence_parallel = sequence_parallel
        self._local_features(in_features, out_features, tp_size, parallel_mode)
        for i in range(num_gemms):
            setattr(self, f"weight{i}", _parameter((self.out_features, self.in_features), params_dtype, init_method))
            if bias:
                setattr(self, f"bias{i}", _parameter((self.out_features,), params_dtype, value=0.0))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=params_dtype))

    def forward(self, x, m_splits, is_first_microbatch=None, **kwargs):
        outs = []
        for i, part in enumerate(torch.split(x, list(m_splits))):
            bias = getattr(self, f"bias{i}") if self.use_bias and not self.return_bias else None
            outs.append(F.linear(part, getattr(self, f"weight{i}"), bias))
        out = torch.cat(outs)
        if self.return_bias:
            return out, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return out


class _Norm(_TEModule):
    normalization = "LayerNorm"

    def __init__(
        self, normalized_shape=None, eps: float = 1e-5, *, zero_centered_gamma=False, hidden_size=None, **kwargs
    ):
        super().__init__()
        size = normalized_shape if normalized_shape is not None else hidden_size
        shape = (size,) if isinstance(size, int) else tuple(size)
        dtype = kwargs.get("params_dtype") or torch.get_default_dtype()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = _parameter(shape, dtype, value=float(not zero_centered_gamma))
        if self.normalization == "LayerNorm":
            self.bias = _parameter(shape, dtype, value=0.0)
        else:
            self.bias = None

    def forward(self, x):
        return _norm(x, self.weight, self.bias, self.eps, self.normalization, self.zero_centered_gamma)


class LayerNorm(_Norm):
    normalization = "LayerNorm"


class RMSNorm(_Norm):
    normalization = "RMSNorm"


class DotProductAttention(_TEModule):
    """No parameters but a learnable softmax's per-head offset; no forward here."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels,
        num_gqa_groups=None,
        attention_dropout: float = 0.0,
        *,
        tp_size: int = 1,
        softmax_type: str = "vanilla",
        **kwargs,
    ) -> None:
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.tp_size = tp_size
        self.softmax_type = softmax_type
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(_split(num_attention_heads, tp_size)))
        else:
            self.softmax_offset = None

    def forward(self, *args, **kwargs):
        raise NotImplementedError("the TransformerEngine stand-in runs no attention")


class TransformerLayer(_TEModule):
    """The bridge subclasses TE's full layer for one spec; it is not stood in."""

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("the TransformerEngine stand-in has no TransformerLayer")
