#!/usr/bin/env python3
"""Is the CPython binding built from the C sources now in this checkout?

    python scripts/source_hash.py check [ROOT]   exit 1 when colibri.runtime._engine must be rebuilt
    python scripts/source_hash.py hash [ROOT]    the hash the binding must carry

scripts/setup.sh runs `check` with the .venv's Python. The logic is in
host_tools/colibri/runtime/sources.py, loaded by path: importing the colibri package
would itself refuse a stale binding.
"""
import importlib.util
import sys
from pathlib import Path

path = Path(__file__).resolve().parents[1] / "host_tools" / "colibri" / "runtime" / "sources.py"
spec = importlib.util.spec_from_file_location("colibri_sources", path)
sources = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sources
spec.loader.exec_module(sources)
sys.exit(sources.main(sys.argv[1:]))
