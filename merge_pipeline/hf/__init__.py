"""The Hugging Face folder format, shared by readers, writer and checks: safetensors files, config, manifest."""
