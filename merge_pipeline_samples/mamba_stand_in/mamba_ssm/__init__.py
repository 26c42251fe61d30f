"""A CPU stand-in for state-spaces' mamba-ssm, for ``.venv-bridge`` only (``scripts/setup_bridge.sh`` copies this package
into its site-packages): with it, megatron-core 0.18.2's ``MambaMixer`` (``megatron/core/ssm/mamba_mixer.py``), which
Megatron-Bridge 0.6.2's Nemotron-H (``HybridModel``) and Falcon-H1 (``FalconH1Model``) layers build, constructs on CPU
and saves its sharded state dict, so a model saved here carries the parameter names and shapes a verl run on GPUs
(mamba-ssm installed) saves: ``mixer.in_proj.weight.{z,x,B,C,dt}``, ``mixer.conv1d.{weight,bias}.{x,B,C}``,
``mixer.{A_log,D,dt_bias}``, ``mixer.norm.weight``.

What is stood in: exactly the names ``mamba_mixer.py`` imports from mamba-ssm, and nothing else.
``ops.triton.layernorm_gated.RMSNorm``: the gated RMSNorm ``MambaMixer`` subclasses as ``ExtendedRMSNorm`` (its
``sharded_state_dict`` is megatron-core's); it registers what mamba-ssm's registers, ``weight`` ``(hidden_size,)``
initialised to ones, ``bias`` registered as None, and keeps ``eps``, ``group_size``, ``norm_before_gate``.
``ops.triton.ssd_combined.mamba_chunk_scan_combined`` and ``mamba_split_conv1d_scan_combined``: the SSD scan
kernels, named only: each raises if called. The norm's forward (a Triton kernel in mamba-ssm) raises too: saving
runs no forward. ``causal_conv1d`` is not stood in: megatron-core imports it in a ``try`` and uses it in the forward
only; megatron-core's own Triton ops (``megatron/core/ssm/ops/``) are its own and import on CPU.

How it was checked against mamba-ssm's source (state-spaces/mamba at 60dadf2, ``mamba_ssm/ops/triton/``): the
constructor's arguments (``hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None,
dtype=None``), the parameters (``weight`` of ``hidden_size`` through ``torch.empty`` then ``ones_``;
``register_parameter("bias", None)``) and the attributes from ``layernorm_gated.py``'s ``RMSNorm``; the kernels'
names from ``ssd_combined.py`` (at 01b717a: ``def mamba_chunk_scan_combined``, ``def mamba_split_conv1d_scan_combined``). The stand-in copies no mamba-ssm code. The names megatron-core then saves were
checked by saving through it and reading the shards back
(``merge_pipeline_tests/formats/megatron/test_bridge_architectures.py``, bit-exact to the bridge's export).
"""

__version__ = "2.2.6"  # a mamba-ssm 2 release: the one megatron-core 0.18.2 asks for to train (2.0.0 or newer)
