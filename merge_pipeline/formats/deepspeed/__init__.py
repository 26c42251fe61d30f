"""DeepSpeed ZeRO 1/2/3 checkpoints (``--backend deepspeed``): ``reader`` plans them."""
