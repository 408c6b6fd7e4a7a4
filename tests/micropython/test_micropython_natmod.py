"""The project's .o -> .mpy linker, `colibri.target.natmod`, and the native modules it builds.

MicroPython's own tools cannot run here (no MicroPython source tree from any
registry), so the project links native modules itself. These tests parse the
files it writes for the Cortex-M7 (armv7emsp, armv7emdp) and x64 with a
reader of the .mpy layout written apart from colibri.target.natmod, from the order in
which MicroPython's loader reads a file (tests/helpers/mpy_format.py; the ABI in
docs/natmod-abi.md), compare
it with `colibri.target.natmod.read_mpy`, and check every refusal the linker must make: each
refused input was a crash at run time when it was let through.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.build import ROOT
from helpers.micropython import MICROPYTHON, build_mpy, shared_build_dir
from helpers.mpy_format import Mpy, parse_mpy

pytestmark = pytest.mark.micropython

COLIBRI = str(Path(sys.executable).parent / "colibri")
FIXTURES = ROOT / "tests" / "natmod_fixtures"
ARCH_CODES = {"x64": 2, "armv7emsp": 7, "armv7emdp": 8}


def on_arch(arch: str):
    """A parameter for an architecture: the ARM ones need the cross compiler."""
    return pytest.param(arch, marks=pytest.mark.cross) if arch.startswith("arm") else arch


WORD = {"x64": 8, "armv7emsp": 4, "armv7emdp": 4}
MP_FUN_TABLE_SLOTS = 87  # slots 0..86, the ABI of mpy sub-version 3
PUBLIC_NAMES = {"Model", "forward", "version", "num_experts", "input_size", "output_size", "max_batch",
                "arena_size",
                # colibri.LM (tests/micropython/test_micropython_lm.py)
                "LM", "reset", "forward_tokens", "generate", "vocab_size", "max_seq_len", "kv_cache_bytes",
                "position", "temperature", "top_k", "top_p", "seed", "out"}


# --------------------------------------------------------------------------- the reader's own checks


def check_relocations(m: Mpy, word: int) -> None:
    """Every adjustment is one the loader performs, on a word inside text or rodata, to a region that exists."""
    assert m.relocs, "a native module with no relocations cannot reach mp_fun_table"
    for dest, index, in_rodata, n in m.relocs:
        size = m.rodata_len if in_rodata else len(m.text)
        assert 0 <= index and (index + n) * word <= size, f"{dest} adjustment at word {index}+{n} outside {size} B"
        if dest.startswith("base"):
            raise AssertionError(f"destination {dest} is no region the loader knows")
        if dest == "rodata":
            assert m.rodata_len, "relocation into rodata, but the module has none"
        if dest == "bss":
            assert m.bss_len, "relocation into bss, but the module has none"
        if dest == "obj_table":
            assert m.n_obj, "relocation into the object table, but the module has no objects"
        if dest.startswith("fun_table["):
            assert int(dest[10:-1]) < MP_FUN_TABLE_SLOTS, f"mp_fun_table has no slot {dest[10:-1]}"


def test_parser_rejects_a_cut_stream() -> None:
    """The reader itself can fail: a module without its end marker, or with a byte after it."""
    # header, 1 qstr "m", 0 objects, 8 bytes of text, scope flags: relocations; word 0 += &mp_fun_table; end
    good = bytes([ord("M"), 6, 2 << 2 | 3, 31, 1, 0, 1 << 1, *b"m", 0, 8 << 3 | 2, *bytes(8), 0x10,
                  8 << 1 | 1, 0 << 1, 0xFF])
    assert parse_mpy(good).relocs == [("fun_table", 0, False, 1)]
    with pytest.raises(AssertionError):
        parse_mpy(good[:-1])
    with pytest.raises(AssertionError):
        parse_mpy(good + b"\x00")


# --------------------------------------------------------------------------- 5. the built modules


@pytest.fixture(scope="module", params=[on_arch(a) for a in ARCH_CODES])
def built(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_mpy(request.param, shared_build_dir(tmp_path_factory))


def test_header_bytes(built: tuple[str, Path]) -> None:
    """'M', version 6, (arch << 2) | sub-version 3, 31 small-int bits: what the interpreter checks first."""
    arch, path = built
    assert path.read_bytes()[:4] == bytes([ord("M"), 6, ARCH_CODES[arch] << 2 | 3, 31])


def test_module_parses_to_the_end(built: tuple[str, Path]) -> None:
    """The whole file parses, the stream ends in its marker, and every relocation is one the loader handles."""
    arch, path = built
    m = parse_mpy(path.read_bytes())
    assert m.arch == ARCH_CODES[arch]
    assert m.qstrs[0].endswith(".mpy") or m.qstrs[0].endswith(".py"), m.qstrs[0]
    assert PUBLIC_NAMES <= set(m.qstrs), PUBLIC_NAMES - set(m.qstrs)
    assert m.n_obj == 0
    assert len(m.text) > 4096  # the engine itself is in there, not just a stub
    check_relocations(m, WORD[arch])
    assert any(dest == "qstr_table" for dest, *_ in m.relocs), "names are stored with ids from the qstr table"
    assert any(dest.startswith("fun") for dest, *_ in m.relocs), "the runtime is reached through mp_fun_table"


def test_read_mpy_agrees(built: tuple[str, Path]) -> None:
    """colibri.target.natmod.read_mpy reports what the independent reader finds, word for word."""
    from colibri.target import natmod

    arch, path = built
    mine = parse_mpy(path.read_bytes())
    theirs = natmod.read_mpy(path)
    assert (theirs.arch, theirs.arch_code, theirs.version, theirs.sub_version) == (arch, ARCH_CODES[arch], 6, 3)
    assert theirs.qstrs == mine.qstrs
    assert (theirs.text_size, theirs.rodata_size, theirs.bss_size) == (len(mine.text), mine.rodata_len, mine.bss_len)
    assert theirs.size == path.stat().st_size
    words = [("rodata" if in_rodata else "text", index + i, dest)
             for dest, index, in_rodata, n in mine.relocs for i in range(n)]
    assert [(r.section, r.word, r.dest) for r in theirs.relocations] == words


@pytest.mark.cross
def test_sp_and_dp_carry_the_same_module(tmp_path_factory) -> None:
    """Both Cortex-M7 flavours carry the same module: same names, same exported API, their own arch code."""
    root = shared_build_dir(tmp_path_factory)
    sp, dp = (parse_mpy(build_mpy(a, root).read_bytes()) for a in ("armv7emsp", "armv7emdp"))
    assert (sp.arch, dp.arch) == (7, 8)
    assert sp.qstrs == dp.qstrs


@pytest.mark.qemu
@pytest.mark.cross
@pytest.mark.parametrize("arch", ["armv7emsp", "armv7emdp"])
def test_arm_module_runs_on_a_cortex_m7(arch: str, tmp_path_factory) -> None:
    """No ARM MicroPython runs here, so a stand-in loader on QEMU's Cortex-M7 applies the relocation
    stream as MicroPython does, imports the module and runs Model/forward: same answers as CPython."""
    import importlib.util

    import numpy as np
    import torch

    import colibri
    from colibri import nn as cnn

    spec = importlib.util.spec_from_file_location("qemu_loader", ROOT / "micropython_module" / "natmod" / "qemu_loader" / "run.py")
    loader = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loader  # its dataclasses look their module up there
    spec.loader.exec_module(loader)
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), cnn.MoE(12, 4, 16, top_k=2, gated=True, activation="silu"),
                                torch.nn.GELU(), torch.nn.Linear(12, 3))
    image = colibri.export(model, None, max_batch=3, dtype="q8").image
    host = colibri.Model(image)
    x = (np.random.default_rng(4).standard_normal((3, 6)) * 3).astype(np.float32)
    result = loader.run(build_mpy(arch, shared_build_dir(tmp_path_factory)), image, x, host.output_size)
    assert result.exit_code == 0, result.log
    want = host.forward(x)
    assert result.y.shape == want.shape, result.log
    assert np.abs(result.y - want).max() <= 1e-6 * (1 + np.abs(want).max())


# --------------------------------------------------------------------------- refusals

# Each refused object, linked together with entry.c (a valid module on its own), so the bad object is
# the only thing wrong: fixture -> (the symbol the refusal must name, what else the message must say).
REFUSALS: dict[str, tuple[str, str]] = {
    "data": ("fixture_table", ".data"),                   # initialised writable global
    "static_bss": ("counter", "static"),                  # static .bss, reached PC-relative
    "undefined": ("fixture_missing_function", "undefined"),
    "tls": ("fixture_tls_value", "thread-local"),
    "absolute": ("fixture_target", "{absolute_reloc}"),   # a relocation type the loader cannot apply
}
ABSOLUTE_RELOC = {"x64": "R_X86_64_32", "armv7emsp": "R_ARM_THM_MOVW_ABS_NC", "armv7emdp": "R_ARM_THM_MOVW_ABS_NC"}
# absolute.c without position independence; on ARM, no literal pools (their words would be R_ARM_ABS32,
# which the linker does turn into relocations), so the address is built by movw/movt.
NON_PIC = {"x64": ["-fno-pic"], "armv7emsp": ["-fno-pic", "-mslow-flash-data"],
           "armv7emdp": ["-fno-pic", "-mslow-flash-data"]}
REFUSAL_ARCHS = ("x64", "armv7emdp")


def compile_fixture(name: str, arch: str, out_dir: Path) -> Path:
    """A fixture compiled by natmod's own compile step, with the flags of the real module build."""
    from colibri.target import natmod

    extra = NON_PIC[arch] if name == "absolute" else []
    return natmod.compile_c(FIXTURES / f"{name}.c", arch, out_dir / arch / f"{name}.o", extra)


@pytest.mark.parametrize("arch", [on_arch(a) for a in REFUSAL_ARCHS])
def test_minimal_module_links(arch: str, tmp_path: Path) -> None:
    """The control for the refusals: entry.c alone links, to a module whose one relocation is mp_fun_table."""
    from colibri.target import natmod

    out = tmp_path / "entry.mpy"
    natmod.link([compile_fixture("entry", arch, tmp_path)], arch, out)
    m = parse_mpy(out.read_bytes())
    assert m.arch == ARCH_CODES[arch] and m.qstrs == ["entry.mpy"]
    assert [dest for dest, *_ in m.relocs] == ["fun_table"]
    check_relocations(m, WORD[arch])


def test_minimal_module_imports(tmp_path: Path) -> None:
    """The x64 control module loads in the real interpreter: import runs mpy_init at text offset 0."""
    from colibri.target import natmod

    natmod.link([compile_fixture("entry", "x64", tmp_path)], "x64", tmp_path / "entry.mpy")
    r = subprocess.run([str(MICROPYTHON), "-c", "import entry; print('imported', entry.__name__)"],
                       env=dict(os.environ, MICROPYPATH=str(tmp_path)), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stdout.strip() == "imported entry", r.stdout + r.stderr


@pytest.mark.parametrize("fixture", REFUSALS)
@pytest.mark.parametrize("arch", [on_arch(a) for a in REFUSAL_ARCHS])
def test_linker_refuses(fixture: str, arch: str, tmp_path: Path) -> None:
    """Each input that once crashed at run time is refused at build time, naming the symbol and the object."""
    from colibri.target import natmod

    symbol, what = REFUSALS[fixture]
    what = what.format(absolute_reloc=ABSOLUTE_RELOC[arch])
    objects = [compile_fixture("entry", arch, tmp_path), compile_fixture(fixture, arch, tmp_path)]
    with pytest.raises(natmod.LinkError) as info:
        natmod.link(objects, arch, tmp_path / "refused.mpy")
    assert not (tmp_path / "refused.mpy").exists()
    problems = str(info.value).splitlines()
    naming = [p for p in problems if f"{fixture}.o" in p and f"'{symbol}'" in p and what in p]
    assert naming, f"no problem names {symbol!r}, {fixture}.o and {what!r}: {problems}"
    assert not any("entry.o" in p for p in problems), problems
    assert len(set(problems)) == len(problems), f"repeated problems: {problems}"
    assert not any(re.search(r"'\$[adtx](\.\w*)?'", p) for p in problems), f"ARM mapping symbol named: {problems}"


def test_rodata_and_bss_are_in_the_loaders_order(tmp_path: Path) -> None:
    """A module with both rodata and bss: MicroPython reads the rodata size, the bss size, then the rodata
    bytes. write_mpy writes that order; the independent reader and read_mpy both find the same sections."""
    from colibri.target import natmod

    path = tmp_path / "both.mpy"
    text, rodata = bytes(range(16)) * 4, b"read-only bytes!"
    natmod.write_mpy(path, "x64", ["both.py", "f"], text, rodata=rodata, bss_size=40)
    mine = parse_mpy(path.read_bytes())
    assert (mine.text, mine.rodata_len, mine.bss_len) == (text, len(rodata), 40)
    theirs = natmod.read_mpy(path)
    assert (theirs.text, theirs.rodata, theirs.bss_size) == (text, rodata, 40)
