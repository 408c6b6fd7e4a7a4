"""`colibri.nn` is colibri.frontends.nn, the PyTorch building blocks: this name is public
(`import colibri.nn`, `from colibri.nn import MoE`), the module lives with the other front ends."""
import sys

from .frontends import nn as _nn

sys.modules[__name__] = _nn
