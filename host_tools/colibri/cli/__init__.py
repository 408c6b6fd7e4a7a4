"""The `colibri` command line, one module per command group. Nothing in the package imports it."""
from . import board, export, flash, info, natmod, quantize, run  # noqa: F401  each registers its commands
from .app import main

__all__ = ["main"]
