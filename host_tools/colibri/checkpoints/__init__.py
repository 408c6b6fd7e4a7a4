"""Checkpoint files read without torch and streamed to an image: Hugging Face folders (config.json and
safetensors shards). Layer: imports colibri.model, colibri.image and colibri.quant."""
