"""Format version 7 on a 32-bit target: the runner firmware on the emulated Cortex-M7 (QEMU mps2-an500),
whose engine has a 32-bit size_t. A small version-7 image runs there bit for bit as on the host; one
whose header says it passes 4 GiB is refused with IMAGE_TOO_LARGE, its own status, where the 64-bit
host engine calls the same bytes TRUNCATED (a buffer that short could still be a prefix of it)."""
from __future__ import annotations

import struct

import numpy as np
import pytest

import colibri
from colibri import image
from colibri.model import format as F
from colibri.model.format import Status
from colibri.target.device import Device, DeviceError
from helpers.target import assert_bits_equal, model_image
from helpers.wide_images import LIMIT_32, fix_crcs

pytestmark = [pytest.mark.qemu, pytest.mark.cross, pytest.mark.usefixtures("no_qemu_left_behind")]


def _wide(data: bytes) -> bytes:
    return image.write(image.read(data), version=F.WIDE_VERSION)


def test_version_7_runs_on_the_cortex_m7_as_on_the_host(dut: Device) -> None:
    for routing, dtype in (("top1", "f32"), ("softmax_topk", "q8")):
        data = _wide(model_image(routing, dtype))
        assert data[4] == F.WIDE_VERSION
        info = dut.load(data)
        assert info.image_size == len(data)
        host = colibri.Model(data, reference_kernels=True)
        x = np.random.default_rng(5).standard_normal((2, host.input_size)).astype(np.float32)
        assert dut.kernels(reference=True)[0]
        y, _ = dut.forward(x)
        assert_bits_equal(y, host.forward(x), f"{routing} {dtype} v7 on the Cortex-M7")


def test_an_image_past_4_gib_is_image_too_large_on_the_cortex_m7(dut: Device) -> None:
    data = bytearray(_wide(model_image("top1", "f32")))
    struct.pack_into("<I", data, 12, LIMIT_32)
    struct.pack_into("<Q", data, F.WIDE_FIELDS_OFFSET, 5 << 30)
    big = fix_crcs(bytes(data))
    assert image.status(big) == Status.TRUNCATED == colibri.runtime._engine.validate(big)
    assert image.status(big, max_image_bytes=LIMIT_32) == Status.IMAGE_TOO_LARGE
    with pytest.raises(DeviceError) as info:
        dut.load(big)
    assert info.value.code == Status.IMAGE_TOO_LARGE
    # 4 GiB - 1 still fits a 32-bit size_t: only the buffer is short of it
    struct.pack_into("<Q", data, F.WIDE_FIELDS_OFFSET, LIMIT_32)
    with pytest.raises(DeviceError) as info:
        dut.load(fix_crcs(bytes(data)))
    assert info.value.code == Status.TRUNCATED
