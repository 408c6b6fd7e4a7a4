"""Front ends: models written in PyTorch (colibri.nn, the exporter) and Hugging Face MoE blocks and causal
LMs, turned into a graph. The only layer that imports torch or transformers."""
