"""Front ends: models written in PyTorch (colibri.nn, the exporter) and Hugging Face MoE blocks and causal
LMs, turned into a graph. The only layer that imports torch: everything else, the image-to-image
commands included, runs without it."""
from ..model.errors import MissingExtraError

try:
    import torch  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "torch":
        raise
    raise MissingExtraError("reading a PyTorch module (colibri.export, colibri.nn, colibri export)", "torch",
                            "torch") from exc
