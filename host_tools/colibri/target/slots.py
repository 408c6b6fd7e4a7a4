"""The A/B model slot format in flash (docs/protocol.md, "Model slots").

A slot holds a 32-byte header, exactly one STM32H7 256-bit flash word, so the
commit is one atomic program operation, followed by the model image at slot
offset 32 (4-byte aligned, flash-word aligned):

    off  type  field
      0  u32   magic: the bytes "CSLT" (u32 0x544C5343 little-endian)
      4  u32   version: 1
      8  u32   sequence: the slot with the highest valid sequence boots
     12  u32   image_size: bytes of the image that follows
     16  u32   image_crc32: CRC-32 (zlib) of those bytes
     20  u32   reserved, 0
     24  u32   reserved, 0
     28  u32   header_crc32: CRC-32 (zlib) of bytes [0, 28)

A slot is valid iff magic, version and header CRC check, image_size fits the
slot, and the image CRC over the bytes in flash matches. The firmware's
reading of it is firmware/runner/slots.c; this module is the host's.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

SLOT_MAGIC = 0x544C5343  # b"CSLT" read as a little-endian u32
SLOT_VERSION = 1
SLOT_HEADER_SIZE = 32
_HEADER = struct.Struct("<7I")  # magic, version, sequence, image_size, image_crc32, reserved x2 (+ header CRC)


@dataclass(frozen=True)
class SlotLayout:
    """Where a board keeps its two slots (the firmware's board_flash_info())."""

    slot_a: int
    slot_b: int
    slot_size: int  # bytes per slot, header included: whole erase sectors
    sector_size: int  # erase unit
    program_size: int = 32  # flash word

    @property
    def capacity(self) -> int:
        """Largest image a slot holds."""
        return self.slot_size - SLOT_HEADER_SIZE

    def address(self, slot: str | int) -> int:
        return self.slot_b if slot in ("B", "b", 1) else self.slot_a


# The boards' flash maps (boards/*/README.md). mps2-an500 has no flash: its
# firmware emulates two slots in QEMU's 16 MB PSRAM, which nothing else uses.
LAYOUTS = {
    "nucleo_h743zi": SlotLayout(0x08100000, 0x08180000, 512 * 1024, 128 * 1024),
    "mps2_an500": SlotLayout(0x60000000, 0x60080000, 512 * 1024, 128 * 1024),
}


@dataclass(frozen=True)
class SlotHeader:
    sequence: int
    image_size: int
    image_crc32: int
    version: int = SLOT_VERSION

    def image_ok(self, image: bytes) -> bool:
        """Whether `image` (at least image_size bytes) is the image this header describes."""
        return len(image) >= self.image_size and zlib.crc32(image[: self.image_size]) == self.image_crc32


def slot_header(image: bytes, sequence: int) -> bytes:
    """The 32-byte header for `image` committed with `sequence`."""
    if not 0 <= sequence <= 0xFFFFFFFF:
        raise ValueError(f"sequence {sequence} is not a u32")
    body = _HEADER.pack(SLOT_MAGIC, SLOT_VERSION, sequence, len(image), zlib.crc32(image), 0, 0)
    return body + struct.pack("<I", zlib.crc32(body))


def slot_image(image: bytes, sequence: int = 1) -> bytes:
    """Header + image: the bytes to write at a slot's address (e.g. by an SWD probe at the factory)."""
    return slot_header(image, sequence) + bytes(image)


def parse_slot_header(data: bytes) -> SlotHeader | None:
    """The header at the start of `data`, or None if magic, version or header CRC do not check.

    The image CRC is not checked here: SlotHeader.image_ok(data[SLOT_HEADER_SIZE:]) does that."""
    if len(data) < SLOT_HEADER_SIZE:
        return None
    magic, version, sequence, size, crc, _, _ = _HEADER.unpack_from(data)
    (header_crc,) = struct.unpack_from("<I", data, _HEADER.size)
    if magic != SLOT_MAGIC or version != SLOT_VERSION or header_crc != zlib.crc32(bytes(data[: _HEADER.size])):
        return None
    return SlotHeader(sequence, size, crc, version)
