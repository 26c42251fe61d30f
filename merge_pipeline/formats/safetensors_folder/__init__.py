"""Consolidated Hugging Face safetensors (``--backend hf``): ``reader`` plans them; its header and index
parsing also serves the readers that find such files inside their own folders."""
