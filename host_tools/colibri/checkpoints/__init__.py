"""Checkpoint files read without torch and streamed to an image: Hugging Face folders (config.json and
safetensors shards, `hf_folder`) and GGUF files (`gguf_file`, through the gguf package). Layer: imports
colibri.model, colibri.image and colibri.quant."""
