"""Megatron-Core role folders (``--backend megatron``): ``reader`` plans them; ``names`` maps Megatron keys
to HF names (with ``bridge_table``, Megatron-Bridge's recorded mappings), ``vocab`` cuts Megatron-LM's
vocabulary padding, ``lm_save`` knows Megatron-LM's own save folders."""
