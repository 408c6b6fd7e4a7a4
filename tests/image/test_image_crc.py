"""The engine's CRC-32 is zlib's, in both builds: the Linux build's slicing-by-8 and the microcontroller
build's nibble loop (COLIBRI_CRC_SLICING, src/colibri_image.c), and its tables are the generator's."""
from __future__ import annotations

import random
import subprocess
import sys
import zlib

import pytest

from helpers.build import CORE, ROOT, make


def test_crc_tables_are_the_generators_output() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_crc_table.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("slicing", [0, 1])
def test_engine_crc_equals_zlib_on_every_alignment_and_tail(tmp_path, slicing: int) -> None:
    r = make("-C", str(CORE), "host")
    assert r.returncode == 0, r.stdout + r.stderr
    exe = tmp_path / f"crc_{slicing}"
    others = [str(p) for p in sorted((CORE / "build" / "host" / "obj").glob("*.o")) if p.name != "colibri_image.o"]
    cc = subprocess.run(["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", f"-DCOLIBRI_CRC_SLICING={slicing}",
                         f"-I{CORE / 'include'}", f"-I{CORE / 'src'}", str(ROOT / "tests" / "c" / "colibri_crc_test.c"),
                         str(CORE / "src" / "colibri_image.c"), *others, "-lm", "-o", str(exe)],
                        capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    rng = random.Random(27)
    data = bytes(rng.getrandbits(8) for _ in range(70_000))
    (tmp_path / "data.bin").write_bytes(data)
    ranges = [(off, n) for off in range(9) for n in range(0, 33)] + [(3, 65_537), (0, 70_000), (5, 69_995)]
    ranges += [(rng.randrange(1000), rng.randrange(60_000)) for _ in range(20)]
    out = subprocess.run([str(exe), str(tmp_path / "data.bin"), *(f"{o}:{n}" for o, n in ranges)],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"{zlib.crc32(data[o:o + n]) & 0xFFFFFFFF:08x}" for o, n in ranges]
