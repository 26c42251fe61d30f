"""Consolidated Hugging Face safetensors (``--backend hf``): ``reader`` plans them; its folder planning also
serves the Megatron reader (the bridge's HF export) and a LoRA-only checkpoint's base model (``base_model``)."""
