"""The Linux libraries (firmware/colibri_core: make shared / make install): libcolibri.so for the host and
aarch64 exports exactly the public API (the functions colibri.h and the POSIX headers mark COLIBRI_API),
has its soname, full RELRO and BIND_NOW; `make install` gives headers, libraries and a pkg-config file
a program builds against; examples/libcolibri/colibri_dlopen loads the library with dlopen, resolves
the API with dlsym and runs a model, on the host and under qemu-aarch64, single-threaded and on the
library's thread pool."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import nn as cnn
from colibri.frontends.exporter import export

from helpers.build import CORE, ROOT, make

EXAMPLE = ROOT / "examples" / "libcolibri"
SYSROOT = "/usr/aarch64-linux-gnu"
TOOLS = {"host": ("nm", "readelf"), "aarch64": ("aarch64-linux-gnu-nm", "aarch64-linux-gnu-readelf")}
NEEDS_AARCH64 = pytest.mark.skipif(
    shutil.which("aarch64-linux-gnu-gcc") is None or shutil.which("qemu-aarch64") is None,
    reason="needs gcc-aarch64-linux-gnu and qemu-user (scripts/setup.sh)")


def public_api() -> set[str]:
    """The functions the public headers declare COLIBRI_API."""
    names = set()
    for h in [CORE / "include" / "colibri.h", CORE / "include" / "colibri_tokenizer.h", *sorted((CORE / "posix").glob("*.h"))]:
        names |= set(re.findall(r"(?m)^COLIBRI_API\b[^;(]*?\b(colibri_\w+)\(", h.read_text()))
    return names


def version() -> str:
    return re.search(r'#define COLIBRI_VERSION_STRING "([^"]+)"', (CORE / "include" / "colibri.h").read_text())[1]


def build_example(variant: str) -> Path:
    r = make("-C", str(EXAMPLE), f"VARIANT={variant}")
    assert r.returncode == 0, r.stdout + r.stderr
    return EXAMPLE / "build" / variant


@pytest.mark.parametrize("variant", ["host", pytest.param("aarch64", marks=[NEEDS_AARCH64, pytest.mark.cross])])
def test_only_the_public_api_is_exported(variant: str) -> None:
    build_example(variant)
    lib = CORE / "build" / variant / f"libcolibri.so.{version()}"
    nm, readelf = TOOLS[variant]
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    api = public_api()
    assert len(api) >= 24 and "colibri_forward_ex" in api and "colibri_pool_create" in api
    assert {"colibri_lm_reset", "colibri_lm_position", "colibri_lm_forward", "colibri_lm_forward_ex", "colibri_lm_sample",
            "colibri_rng_seed"} <= api
    assert exported == api, f"extra: {sorted(exported - api)}, missing: {sorted(api - exported)}"
    print(f"{variant}: {len(exported)} exported symbols")

    dyn = subprocess.run([readelf, "-dW", str(lib)], capture_output=True, text=True, check=True).stdout
    assert f"Library soname: [libcolibri.so.{version().split('.')[0]}]" in dyn
    assert "BIND_NOW" in dyn and "TEXTREL" not in dyn
    segments = subprocess.run([readelf, "-lW", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "GNU_RELRO" in segments
    for link in (f"libcolibri.so.{version().split('.')[0]}", "libcolibri.so"):
        assert os.readlink(CORE / "build" / variant / link) == lib.name


def test_make_install_and_pkg_config(tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    r = make("-C", str(CORE), "install", f"PREFIX={prefix}")
    assert r.returncode == 0, r.stdout + r.stderr
    major = version().split(".")[0]
    for rel in ("include/colibri.h", "include/colibri_format.h", "include/colibri_pool.h", "lib/libcolibri.a",
                f"lib/libcolibri.so.{version()}", f"lib/libcolibri.so.{major}", "lib/libcolibri.so",
                "lib/pkgconfig/colibri.pc"):
        assert (prefix / rel).exists(), rel
    if shutil.which("pkg-config") is None:
        pytest.skip("pkg-config missing (scripts/setup.sh installs pkgconf)")
    env = {**os.environ, "PKG_CONFIG_PATH": str(prefix / "lib" / "pkgconfig")}
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "colibri"], capture_output=True, text=True,
                           env=env, check=True).stdout.split()
    assert f"-I{prefix}/include" in flags and f"-L{prefix}/lib" in flags and "-lcolibri" in flags
    assert subprocess.run(["pkg-config", "--modversion", "colibri"], capture_output=True, text=True, env=env,
                          check=True).stdout.strip() == version()
    src = tmp_path / "uses.c"
    src.write_text('#include <stdio.h>\n#include "colibri.h"\n#include "colibri_pool.h"\n'
                   "int main(void) { colibri_pool *p; if (colibri_pool_create(&p, 2)) return 1;\n"
                   '  printf("%s %zu\\n", colibri_version(), colibri_pool_workers(p)); colibri_pool_destroy(p); return 0; }\n')
    exe = tmp_path / "uses"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Werror", str(src), *flags, "-o", str(exe)], check=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, env={"LD_LIBRARY_PATH": str(prefix / "lib")})
    assert r.returncode == 0 and r.stdout.strip() == f"{version()} 2", r.stdout + r.stderr
    needed = subprocess.run(["readelf", "-dW", str(exe)], capture_output=True, text=True, check=True).stdout
    assert f"[libcolibri.so.{major}]" in needed


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path, np.ndarray]:
    """An MoE image (two MoE layers, one with a shared expert), an input file and the binding's output."""
    torch.manual_seed(7)
    net = torch.nn.Sequential(torch.nn.Linear(24, 40), cnn.MoE(40, 6, 64, top_k=2, routing="topk_softmax",
                                                               activation="silu", gated=True),
                              cnn.MoE(40, 4, 48, top_k=1, routing="top1", num_shared=1, shared_hidden=16),
                              torch.nn.Linear(40, 10)).eval()
    d = tmp_path_factory.mktemp("libcolibri")
    image, inp = d / "m.clb", d / "in.f32"
    export(net, image, max_batch=32)
    x = np.random.default_rng(3).standard_normal((32, 24)).astype(np.float32)
    inp.write_bytes(x.tobytes())
    return image, inp, colibri.Model(image.read_bytes()).forward(x)


def _run(cmd: list[str], out: Path, env: dict | None = None) -> np.ndarray:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"colibri {version()} ")
    return np.fromfile(out, dtype=np.float32).reshape(32, 10)


def test_dlopen_example_runs_a_model(model, tmp_path: Path) -> None:
    image, inp, expected = model
    b = build_example("host")
    one = _run([str(b / "colibri_dlopen"), str(b / "libcolibri.so.0"), str(image), str(inp), str(tmp_path / "1")],
               tmp_path / "1")
    two = _run([str(b / "colibri_dlopen"), str(b / "libcolibri.so.0"), str(image), str(inp), str(tmp_path / "2"), "2"],
               tmp_path / "2")
    np.testing.assert_allclose(one, expected, rtol=1e-5, atol=1e-5)
    assert one.tobytes() == two.tobytes()  # the thread pool: the same bits


@pytest.mark.qemu
@pytest.mark.cross
@NEEDS_AARCH64
def test_dlopen_example_on_aarch64(model, tmp_path: Path) -> None:
    image, inp, expected = model
    b = build_example("aarch64")
    env = {**os.environ, "QEMU_LD_PREFIX": SYSROOT}
    outs = [_run(["qemu-aarch64", str(b / "colibri_dlopen"), str(b / "libcolibri.so.0"), str(image), str(inp),
                  str(tmp_path / w), w], tmp_path / w, env) for w in ("1", "2")]
    np.testing.assert_allclose(outs[0], expected, rtol=1e-4, atol=1e-4)
    assert outs[0].tobytes() == outs[1].tobytes()
