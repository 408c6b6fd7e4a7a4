"""Colibri: Mixture-of-Experts models on microcontrollers.

    import colibri
    colibri.export(torch_model, "model.clb", max_batch=8)
    model = colibri.Model("model.clb")      # the C engine
    y = model.forward(x)                    # x: [batch, input_size] float32
    y_ref = colibri.reference.run(colibri.image.read(open("model.clb", "rb").read()), x)
"""
from __future__ import annotations

from . import image, reference
from .model import format, ir
from .runtime.engine import LM, Model, arena_size, validate, version
from .model.errors import (
    ArenaError, ColibriError, ExportError, ImageError, InputError, MissingExtraError, ModelFileError, UnsupportedError,
)
from .model.format import Status

__version__ = "0.1.0"


def export(model, *args, **kwargs):
    """Export a model to a model image. A Hugging Face folder (config.json and safetensors) is
    streamed to the file one tensor at a time, see colibri.checkpoints.hf_folder.export_folder
    (`max_seq_len=` required); a GGUF file too, see colibri.checkpoints.gguf_file.export_gguf.
    A PyTorch model (imports torch on first use): a Hugging Face MoE causal LM (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) or a colibri.nn.MoETransformer as a token model,
    see colibri.frontends.hf_lm.export_lm
    (`max_seq_len=` required); anything else see colibri.frontends.exporter.export."""
    from .checkpoints import gguf_file, hf_folder

    if hf_folder.is_folder(model):  # a Hugging Face folder: streamed, without torch (issue 26)
        return hf_folder.export_folder(model, *args, **kwargs)
    if gguf_file.is_gguf(model):  # a GGUF file: the same, through the gguf package
        return gguf_file.export_gguf(model, *args, **kwargs)
    from .frontends import hf  # noqa: F401  registers the Hugging Face block converters
    from .frontends import hf_lm

    if hf_lm.is_token_module(model):
        return hf_lm.export_lm(model, *args, **kwargs)
    from .frontends.exporter import export as _export

    return _export(model, *args, **kwargs)


__all__ = [
    "ArenaError", "ColibriError", "ExportError", "ImageError", "InputError", "LM", "MissingExtraError", "Model",
    "ModelFileError", "Status",
    "UnsupportedError", "arena_size", "export", "format", "image", "ir", "reference", "validate", "version",
]
