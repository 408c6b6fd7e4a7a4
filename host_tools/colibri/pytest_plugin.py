"""`colibri.pytest_plugin` is colibri.target.pytest_plugin, the pytest plugin (the `dut` fixture, the
--colibri-* options): this name is public (`-p colibri.pytest_plugin`, `pytest_plugins = [...]`, the
pytest11 entry point's name), the module lives with the other targets. One module object under both
names, so pytest never registers the plugin twice."""
import sys

from .target import pytest_plugin as _plugin

sys.modules[__name__] = _plugin
