"""Builds colibri.runtime._engine, the CPython binding, from the engine's own sources, and
colibri.quant._q4_search, the quantiser's q4 clip search in C.

The source list is firmware/colibri_core/sources.txt, shared with the
engine's Makefile, so `pip install .` needs no separate build step.

The binding carries the hash of the sources it is built from (SOURCE_HASH;
host_tools/colibri/runtime/sources.py), so a checkout refuses a stale build. The wheel
also carries the C sources the commands compile (sources.PACKAGED) under
colibri/_src; the sdist carries them at their checkout paths (MANIFEST.in).
"""
import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CORE = Path("firmware/colibri_core")
sources = [str(CORE / line.strip()) for line in (CORE / "sources.txt").read_text().splitlines() if line.strip()]

# colibri/runtime/sources.py by path: the package itself cannot be imported before it is built.
_spec = importlib.util.spec_from_file_location("colibri_sources", ROOT / "host_tools" / "colibri" / "runtime" / "sources.py")
src = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = src
_spec.loader.exec_module(src)


class BuildPyWithSources(build_py):
    """Copies the C sources into colibri/_src, where colibri.runtime.sources finds them once installed."""

    def run(self):
        super().run()
        if self.editable_mode:
            return  # an editable install compiles from the checkout itself
        dest = Path(self.build_lib) / "colibri" / "_src"
        for rel in src.files(ROOT, src.PACKAGED):
            self.mkpath(str((dest / rel).parent))
            self.copy_file(str(ROOT / rel), str(dest / rel))


setup(
    cmdclass={"build_py": BuildPyWithSources},
    ext_modules=[
        Extension(
            "colibri.runtime._engine",
            # The POSIX file layer (mmap, madvise, mlock) beside the core: colibri.Model(path) maps files;
            # its thread pool: colibri.LM(workers=N).
            sources=["host_tools/colibri/runtime/_engine.c", *sources, str(CORE / "posix" / "colibri_file.c"),
                     str(CORE / "posix" / "colibri_pool.c")],
            include_dirs=[str(CORE / "include"), str(CORE / "src"), str(CORE / "posix")],
            define_macros=[("COLIBRI_SOURCE_HASH", f'"{src.source_hash(ROOT)}"')],
            # -ffp-contract=off -fno-math-errno: the engine's floating-point contract
            # (firmware/colibri_core/Makefile), whatever CFLAGS Python was built with.
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-math-errno"],
        ),
        Extension(
            "colibri.quant._q4_search",
            # The q4 clip search of colibri/quant/quantize.py. -O3 vectorises it across groups, which
            # keeps each group's float32 operations and their order (no -ffast-math: nothing is
            # reassociated); -ffp-contract=off keeps numpy's separate roundings (no fused multiply-add).
            sources=["host_tools/colibri/quant/_q4_search.c"],
            define_macros=[("COLIBRI_SOURCE_HASH", f'"{src.source_hash(ROOT)}"')],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-math-errno"],
        ),
    ]
)
