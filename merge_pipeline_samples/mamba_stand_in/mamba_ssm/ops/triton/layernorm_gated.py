"""mamba-ssm's gated RMSNorm: its parameters, no kernel (see the package's docstring)."""

import torch


class RMSNorm(torch.nn.Module):
    """``weight`` of ``hidden_size`` (ones), no bias, as mamba-ssm's; a forward would run a Triton kernel: it raises."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate

    def forward(self, x, z=None):
        raise NotImplementedError("mamba-ssm stand-in: the gated RMSNorm's Triton kernel is not stood in")
