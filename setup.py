"""Builds colibri._engine, the CPython binding, from the engine's own sources.

The source list is firmware/colibri_core/sources.txt, shared with the
engine's Makefile, so `pip install .` needs no separate build step.
"""
from pathlib import Path

from setuptools import Extension, setup

CORE = Path("firmware/colibri_core")
sources = [str(CORE / line.strip()) for line in (CORE / "sources.txt").read_text().splitlines() if line.strip()]

setup(
    ext_modules=[
        Extension(
            "colibri._engine",
            sources=["host_tools/colibri/_engine.c", *sources],
            include_dirs=[str(CORE / "include"), str(CORE / "src")],
            # -ffp-contract=off -fno-math-errno: the engine's floating-point contract
            # (firmware/colibri_core/Makefile), whatever CFLAGS Python was built with.
            extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wextra", "-ffp-contract=off", "-fno-math-errno"],
        )
    ]
)
