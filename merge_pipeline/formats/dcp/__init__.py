"""torch.distributed.checkpoint folders (``--backend dcp``): ``reader`` plans them; ``hf_storage`` reads DCP
saved as unconsolidated safetensors, ``torchtitan_names`` maps torchtitan's names to HF names."""
