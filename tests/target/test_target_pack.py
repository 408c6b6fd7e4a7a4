"""colibri pack: the C array compiles, links and runs in the engine with the same answers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import colibri
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.target.pack import c_array

from helpers.build import CORE, build_c_tests

COLIBRI = str(Path(sys.executable).parent / "colibri")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(6, 12), cnn.MoE(12, 3, 16, top_k=2, gated=True), torch.nn.Linear(12, 2))
    path = tmp_path_factory.mktemp("pack") / "m.clb"
    export(m, path, max_batch=3, dtype="q8")
    return path


MAIN = r"""
#include <stdio.h>
#include "colibri.h"
#include "model.h"

static uint8_t arena[COLIBRI_MODEL_ARENA_SIZE] __attribute__((aligned(8)));

int main(void) {
    colibri_ctx *ctx;
    float in[COLIBRI_MODEL_MAX_BATCH * COLIBRI_MODEL_INPUT_SIZE], out[COLIBRI_MODEL_MAX_BATCH * COLIBRI_MODEL_OUTPUT_SIZE];
    for (unsigned i = 0; i < sizeof in / sizeof in[0]; i++) in[i] = (float)i / 10.0f - 1.0f;
    int st = colibri_init(&ctx, arena, sizeof arena, colibri_model_image, colibri_model_image_len);
    if (st) { printf("init: %s\n", colibri_strerror(st)); return 1; }
    st = colibri_forward(ctx, COLIBRI_MODEL_MAX_BATCH, in, sizeof in / sizeof in[0], out, sizeof out / sizeof out[0]);
    if (st) { printf("forward: %s\n", colibri_strerror(st)); return 1; }
    for (unsigned i = 0; i < sizeof out / sizeof out[0]; i++) printf("%.9g\n", out[i]);
    return 0;
}
"""


def test_c_array_links_and_runs(model_file: Path, tmp_path: Path) -> None:
    data = model_file.read_bytes()
    packed = c_array(data, tmp_path / "gen")
    header = packed.header.read_text()
    m = colibri.Model(data)
    assert f"#define COLIBRI_MODEL_ARENA_SIZE {m.arena_size}u" in header
    assert "#define COLIBRI_MODEL_NUM_EXPERTS 3u" in header and "#define COLIBRI_MODEL_MAX_BATCH 3u" in header
    (tmp_path / "main.c").write_text(MAIN)
    build_c_tests("host")  # builds the host libcolibri.a
    exe = tmp_path / "app"
    subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I", str(CORE / "include"), "-I", str(packed.header.parent),
                    str(tmp_path / "main.c"), str(packed.source), str(CORE / "build" / "host" / "libcolibri.a"), "-lm",
                    "-o", str(exe)], check=True)
    got = np.array(subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split(), dtype=np.float32)
    x = (np.arange(3 * 6, dtype=np.float32) / 10 - 1).reshape(3, 6)
    np.testing.assert_allclose(got.reshape(3, 2), m.forward(x), rtol=1e-6, atol=1e-7)
    # The array sits in its own section, 32-byte aligned.
    obj = tmp_path / "model.o"
    subprocess.run(["gcc", "-c", "-I", str(packed.header.parent), str(packed.source), "-o", str(obj)], check=True)
    sections = subprocess.run(["objdump", "-h", str(obj)], capture_output=True, text=True, check=True).stdout
    line = next(line for line in sections.splitlines() if ".rodata.colibri_model" in line)
    assert line.split()[-1] == "2**5"


def test_cli_c_array(model_file: Path, tmp_path: Path) -> None:
    r = subprocess.run([COLIBRI, "pack", str(model_file), "--c-array", str(tmp_path / "out"), "--name", "meter_model"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "meter_model_image" in (tmp_path / "out" / "model.c").read_text()
    assert "#define METER_MODEL_IMAGE_SIZE" in (tmp_path / "out" / "model.h").read_text()
    bad = subprocess.run([COLIBRI, "pack", str(model_file), "--c-array", str(tmp_path / "o2"), "--name", "9bad"],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "not a C identifier" in bad.stderr


@pytest.mark.parametrize("board,slot", [("nucleo_h743zi", "a"), ("nucleo_h743zi", "b"), ("mps2_an500", "b")])
def test_flash_image_hex_round_trips(model_file: Path, tmp_path: Path, board: str, slot: str) -> None:
    from intelhex import IntelHex

    from colibri.target import slots
    from colibri.target.pack import flash_image

    data = model_file.read_bytes()
    fi = flash_image(data, tmp_path / "slot", board=board, slot=slot, sequence=7)
    layout = slots.LAYOUTS[board]
    assert fi.address == (layout.slot_b if slot == "b" else layout.slot_a)
    raw = fi.bin.read_bytes()
    assert raw[slots.SLOT_HEADER_SIZE :] == data
    header = slots.parse_slot_header(raw)
    assert header is not None and header.sequence == 7 and header.image_ok(raw[slots.SLOT_HEADER_SIZE :])
    ih = IntelHex(str(fi.hex))
    assert ih.minaddr() == fi.address and ih.maxaddr() == fi.address + len(raw) - 1
    assert ih.tobinstr(start=fi.address, size=len(raw)) == raw


def test_flash_image_refusals(model_file: Path, tmp_path: Path) -> None:
    from colibri.target.pack import flash_image

    with pytest.raises(ValueError, match="unknown board"):
        flash_image(model_file.read_bytes(), tmp_path / "x", board="esp32")
    with pytest.raises(colibri.ImageError):
        flash_image(b"not an image" * 10, tmp_path / "x")
    r = subprocess.run([COLIBRI, "pack", str(model_file), "--flash-image", str(tmp_path / "s"), "--slot", "b"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "slot B of nucleo_h743zi at 0x08180000" in r.stdout


# --------------------------------------------------------------------------- format versions


def with_version(data: bytes, version: int) -> bytes:
    b = bytearray(data)
    b[4:6] = version.to_bytes(2, "little")  # outside the CRC: the image stays intact otherwise
    return bytes(b)


def fake_firmware(path: Path, formats: tuple[int, int] | None) -> Path:
    """A firmware file carrying runner.c's format record (or none, as every runner before it)."""
    from colibri.target.pack import FORMATS_RECORD, FORMATS_TAG

    record = FORMATS_RECORD.pack(FORMATS_TAG, *formats) if formats else b""
    path.write_bytes(b"\x00" * 256 + record + b"\xff" * 64)
    return path


@pytest.fixture(scope="module")
def runner_elf() -> Path:
    from helpers.build import ROOT, make

    r = make("-C", str(ROOT / "firmware" / "runner"), "BOARD=nucleo_h743zi")
    assert r.returncode == 0, r.stdout + r.stderr
    return ROOT / "firmware" / "runner" / "build" / "nucleo_h743zi" / "runner.elf"


@pytest.mark.cross
def test_firmware_formats_from_elf_bin_and_hex(runner_elf: Path, tmp_path: Path) -> None:
    """The runner carries the versions its engine reads; found in each file kind a programmer takes."""
    from colibri.model import format as F
    from colibri.target.pack import firmware_formats

    want = (F.MIN_READ_VERSION, F.MAX_READ_VERSION)
    assert firmware_formats(runner_elf) == want
    assert firmware_formats(runner_elf.with_suffix(".bin")) == want
    hex_path = tmp_path / "runner.hex"
    subprocess.run(["arm-none-eabi-objcopy", "-O", "ihex", str(runner_elf), str(hex_path)], check=True)
    assert firmware_formats(hex_path) == want
    assert firmware_formats(fake_firmware(tmp_path / "new.bin", (2, 5))) == (2, 5)
    assert firmware_formats(fake_firmware(tmp_path / "old.bin", None)) == (1, 1)  # before the record: format 1


@pytest.mark.cross
def test_flash_image_refuses_a_version_the_firmware_does_not_read(model_file: Path, tmp_path: Path,
                                                                  runner_elf: Path, monkeypatch) -> None:
    from colibri.model import format as F
    from colibri.model.errors import ImageError
    from colibri.target.pack import flash_image

    from colibri import image

    # relabelled from the newest layout (v7: a feature model with int4 weights, 96-byte header), so a
    # reader of the next version reads it as this one would
    from colibri.frontends.exporter import export

    torch.manual_seed(0)
    graph = export(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
                   dtype="q4", group=8).graph
    newer = with_version(image.write(graph, version=F.MAX_READ_VERSION), F.MAX_READ_VERSION + 1)
    with pytest.raises(ImageError) as exc:  # newer than the engine packaged with this colibri
        flash_image(newer, tmp_path / "a")
    assert exc.value.status == F.Status.UNSUPPORTED_VERSION and not (tmp_path / "a.bin").exists()
    # A colibri that reads the next version too, packing for a runner that does not: the firmware decides.
    monkeypatch.setattr(F, "MAX_READ_VERSION", F.MAX_READ_VERSION + 1)
    flash_image(newer, tmp_path / "ok")  # no firmware named: this colibri's engine is the target
    with pytest.raises(ImageError) as exc:
        flash_image(newer, tmp_path / "b", firmware=runner_elf)
    assert exc.value.status == F.Status.UNSUPPORTED_VERSION and not (tmp_path / "b.bin").exists()
    assert f"is newer than firmware runner.elf reads (1..{F.MAX_READ_VERSION - 1})" in str(exc.value)
    flash_image(newer, tmp_path / "c", firmware=fake_firmware(tmp_path / "fw.bin", (1, F.MAX_READ_VERSION)))
    assert (tmp_path / "c.bin").exists()


def test_cli_pack_and_probe_refuse_versions(model_file: Path, tmp_path: Path) -> None:
    """`pack --flash-image` and `flash --probe` make the check the runner makes over serial, before
    anything is written: for this colibri's engine, or for the firmware named with --firmware."""
    import os

    from colibri.model import format as F

    from helpers.slots import FAKE_PYOCD

    newer = tmp_path / "newer.clb"
    newer.write_bytes(with_version(model_file.read_bytes(), F.MAX_READ_VERSION + 1))
    future_fw = fake_firmware(tmp_path / "future.bin", (F.MAX_READ_VERSION + 1, F.MAX_READ_VERSION + 1))
    bin_dir, log = tmp_path / "bin", tmp_path / "pyocd.log"
    bin_dir.mkdir()
    (bin_dir / "pyocd").write_text(FAKE_PYOCD.format(log=log, fail=""))
    (bin_dir / "pyocd").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    # a slot .hex written before (as a factory would keep it), then made newer
    good_hex = tmp_path / "slot"
    r = subprocess.run([COLIBRI, "pack", str(model_file), "--flash-image", str(good_hex)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from intelhex import IntelHex

    ih = IntelHex(str(good_hex.with_suffix(".hex")))
    from colibri.target import slots

    raw = ih.tobinstr(start=ih.minaddr(), end=ih.maxaddr())
    newer_slot = slots.slot_image(with_version(raw[slots.SLOT_HEADER_SIZE:], F.MAX_READ_VERSION + 1), 3)
    newer_hex = tmp_path / "newer-slot.hex"
    out = IntelHex()
    out.frombytes(newer_slot, offset=ih.minaddr())
    out.write_hex_file(str(newer_hex))
    newer_bin = tmp_path / "newer-slot.bin"
    newer_bin.write_bytes(newer_slot)

    cases = [
        (["pack", str(newer), "--flash-image", str(tmp_path / "x")], "newer than this engine reads"),
        (["pack", str(model_file), "--flash-image", str(tmp_path / "y"), "--firmware", str(future_fw)],
         f"is older than firmware future.bin reads ({F.MAX_READ_VERSION + 1}..{F.MAX_READ_VERSION + 1})"),
        (["flash", str(newer), "--probe"], "newer than this engine reads"),
        (["flash", str(newer_bin), "--probe"], "newer than this engine reads"),
        (["flash", str(newer_hex), "--probe"], "newer than this engine reads"),
        (["flash", str(model_file), "--probe", "--firmware", str(future_fw)], "is older than firmware future.bin"),
    ]
    for args, message in cases:
        r = subprocess.run([COLIBRI, *args], capture_output=True, text=True, env=env)
        assert r.returncode == 1 and message in r.stderr and r.stderr.count("\n") == 1, (args, r.stderr)
        assert str(F.Status.UNSUPPORTED_VERSION.value) in r.stderr or "format version" in r.stderr
    assert not log.exists(), "pyocd ran for an image the firmware cannot read"
    assert not (tmp_path / "x.bin").exists() and not (tmp_path / "y.bin").exists()
    # the same slot .hex unchanged goes through
    r = subprocess.run([COLIBRI, "flash", str(good_hex.with_suffix(".hex")), "--probe"], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 0, r.stderr
