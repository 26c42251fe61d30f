"""TE's fused MoE router kernels, imported by megatron-core from TE 2.7 on; the writer turns router fusion off."""


def _not_stood_in(*args, **kwargs):
    raise NotImplementedError("the TransformerEngine stand-in has no fused router kernels (moe_router_fusion=False)")


fused_topk_with_score_function = fused_compute_score_for_moe_aux_loss = fused_moe_aux_loss = _not_stood_in
