"""The `colibri` command line. Nothing in the package imports it."""
from .app import main

__all__ = ["main"]
