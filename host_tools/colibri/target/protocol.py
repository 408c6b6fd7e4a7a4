"""The runner wire protocol (docs/protocol.md): packets, COBS framing, CRC-32.

Pure functions over bytes; `colibri.target.device` moves them over a serial port.
"""
from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

from cobs import cobs

VERSION = 5  # 2: HELLO reports the model image format versions the engine reads; 3: KERNELS;
# 4: token models: LM_RESET, FORWARD_TOKENS, GENERATE, and INFO adds vocab_size, max_seq_len, kv_cache_bytes;
# 5: GENERATE_TEXT, the image's tokenizer on the target (text or ids in, ids and text out, EOS ends it)
MAX_PAYLOAD = 4096
HEADER = struct.Struct("<BBHI")  # type, flags, seq, length
CRC = struct.Struct("<I")
RESPONSE = 0x80
UNKNOWN_SEQ = 0xFFFF
MESSAGE_MAX = 96


class Type(enum.IntEnum):
    HELLO = 0x01
    LOAD_BEGIN = 0x10
    LOAD_CHUNK = 0x11
    LOAD_END = 0x12
    INFO = 0x20
    KERNELS = 0x21  # which kernels the engine runs: optimised (0) or reference (1)
    FORWARD = 0x30
    LM_RESET = 0x31  # token models (docs/lm.md): empty the KV cache
    FORWARD_TOKENS = 0x32  # token ids in, logits out
    GENERATE = 0x33  # prompt in, sampled on the target, new ids out
    GENERATE_TEXT = 0x34  # GENERATE with the image's tokenizer on the target: text in, ids and text out
    STATS = 0x40
    RESET = 0x50
    SLOT_INFO = 0x60
    UPDATE_BEGIN = 0x61
    UPDATE_CHUNK = 0x62
    UPDATE_COMMIT = 0x63
    POWER_CUT_AFTER = 0x6F  # debug, emulated boards only
    FAULT = 0x6E  # debug, emulated boards only: the core faults on purpose
    STATUS = 0x7F


KERNELS_OPTIMISED = 0  # KERNELS: the build's optimised kernels (the default at reset)
KERNELS_REFERENCE = 1  # KERNELS: the reference kernels, the specification (bit for bit with the host's)


FORWARD_TOKENS_REQUEST = struct.Struct("<II")  # n, rows; then n i32 ids
FORWARD_TOKENS_RESPONSE = struct.Struct("<IIIIQ")  # n, rows, position, work_kind, work; then rows x vocab f32
ROWS_ALL = 0  # FORWARD_TOKENS: every row's logits
ROWS_LAST = 1  # FORWARD_TOKENS: the last row's only
GENERATE_REQUEST = struct.Struct("<IfIfQI")  # max_new_tokens, temperature, top_k, top_p, seed, n_prompt; then ids
GENERATE_RESPONSE = struct.Struct("<IIQQQ")  # count, work_kind, prefill, decode, sample work; then count i32 ids
# GENERATE_TEXT (protocol 5): GENERATE's fields with flags before n_prompt; the prompt is n_prompt i32 ids, or
# n_prompt bytes of UTF-8 with PROMPT_TEXT. The response adds the prompt's id count and the text's bytes; then
# count i32 ids, then the text (the new ids decoded on the target, whole characters, the end flushed).
GENERATE_TEXT_REQUEST = struct.Struct("<IfIfQII")  # max_new_tokens, temperature, top_k, top_p, seed, flags, n_prompt
GENERATE_TEXT_RESPONSE = struct.Struct("<IIQQQII")  # count, work_kind, prefill, decode, sample, prompt ids, text bytes
GENERATE_TEXT_PROMPT_TEXT = 1  # the prompt is UTF-8 text, encoded by the image's tokenizer on the target
GENERATE_TEXT_STOP_AT_EOS = 2  # the tokenizer's EOS ends the run (it is the last id)


class ProtocolStatus(enum.IntEnum):
    FRAME_CRC = -100
    FRAME_DECODE = -101
    FRAME_TOO_LONG = -102
    FRAME_LENGTH = -103
    UNKNOWN_TYPE = -104
    BAD_PAYLOAD = -105
    NO_MODEL = -106
    LOAD_SEQUENCE = -107
    LOAD_CRC = -108
    TOO_LARGE = -109
    FLASH_ERROR = -110


class SlotState(enum.IntEnum):
    """What SLOT_INFO found in a slot."""

    EMPTY = 0  # header word erased
    VALID = 1
    BAD_HEADER = 2  # magic, version, header CRC or size wrong
    BAD_IMAGE = 3  # header fine, image CRC wrong
    UNREADABLE = 4  # uncorrectable ECC error in the header word


RUNNING_BUILTIN = 0xFD  # SLOT_INFO `running`: the model linked into the firmware (colibri pack --c-array)
RUNNING_RAM = 0xFE  # SLOT_INFO `running`: a model uploaded into RAM with LOAD_*
RUNNING_NONE = 0xFF
SLOT_INFO = struct.Struct("<IIIBBBB")  # slot_size, sector_size, program_size, active, running, updating, 0
SLOT_ENTRY = struct.Struct("<IBBHIII")  # address, state, 0, 0, sequence, image_size, image_crc32


class WorkKind(enum.IntEnum):
    NONE = 0
    QEMU_INSTRUCTIONS = 1  # instructions counted under QEMU -icount, not cycles
    DWT_CYCLES = 2  # core clock cycles on hardware

    @property
    def unit(self) -> str:
        return {0: "", 1: "instructions (QEMU -icount, not cycles)", 2: "cycles (DWT)"}[int(self)]


@dataclass
class Packet:
    type: int
    seq: int
    payload: bytes = b""
    flags: int = 0


class FrameError(ValueError):
    """A frame that does not decode to a valid packet."""


def encode(packet: Packet) -> bytes:
    """Packet -> COBS frame with its 0x00 delimiter."""
    body = HEADER.pack(packet.type, packet.flags, packet.seq, len(packet.payload)) + packet.payload
    return cobs.encode(body + CRC.pack(zlib.crc32(body))) + b"\x00"


def decode(frame: bytes) -> Packet:
    """One frame without its delimiter -> Packet, or FrameError."""
    try:
        raw = cobs.decode(frame)
    except cobs.DecodeError as exc:
        raise FrameError(f"bad COBS: {exc}") from None
    if len(raw) < HEADER.size + CRC.size:
        raise FrameError(f"packet of {len(raw)} bytes is shorter than header + CRC")
    ptype, flags, seq, length = HEADER.unpack_from(raw)
    if HEADER.size + length + CRC.size != len(raw):
        raise FrameError(f"length field {length} disagrees with a {len(raw)}-byte packet")
    (crc,) = CRC.unpack_from(raw, len(raw) - CRC.size)
    if crc != zlib.crc32(raw[: -CRC.size]):
        raise FrameError("CRC mismatch")
    return Packet(ptype, seq, bytes(raw[HEADER.size : -CRC.size]), flags)


def status_payload(packet: Packet) -> tuple[int, str]:
    """(code, message) of a STATUS packet."""
    (code,) = struct.unpack_from("<i", packet.payload)
    return code, packet.payload[4:].decode("utf-8", "replace")


def status_name(code: int) -> str:
    from ..model.format import Status

    for enum_cls in (ProtocolStatus, Status):
        try:
            return enum_cls(code).name
        except ValueError:
            pass
    return str(code)
