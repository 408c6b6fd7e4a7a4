"""A client for the runner firmware over a serial port (pyserial).

    with Device("socket://127.0.0.1:4321") as dut:      # QEMU
    with Device("/dev/ttyACM0", baudrate=115200) as dut: # a board
        print(dut.hello())
        dut.load(image_bytes)
        y, work = dut.forward(x)
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import serial

from . import protocol as P
from .errors import ColibriError

CHUNK = P.MAX_PAYLOAD - 4  # LOAD_CHUNK carries a u32 offset


class DeviceError(ColibriError):
    """The device answered with a STATUS frame, or not at all."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class Hello:
    protocol_version: int
    max_payload: int
    model_capacity: int
    arena_capacity: int
    work_kind: P.WorkKind
    board: str
    engine_version: str
    build_flags: str


@dataclass
class DeviceInfo:
    input_size: int
    output_size: int
    max_batch: int
    num_layers: int
    num_experts: int
    image_size: int
    arena_size: int


@dataclass
class Stats:
    stack_size: int
    stack_used: int
    model_capacity: int
    arena_capacity: int
    arena_used: int


@dataclass
class Work:
    kind: P.WorkKind
    count: int

    def __str__(self) -> str:
        return f"{self.count:,} {self.kind.unit}" if self.kind else "not measured"


class Device:
    """One runner on the other end of a serial line; every call is one request and its answer."""

    def __init__(self, url: str, *, baudrate: int = 115200, timeout: float = 10.0):
        self.port = serial.serial_for_url(url, baudrate=baudrate, timeout=timeout)
        self.timeout = timeout
        self._seq = 0
        self._rx = bytearray()
        self.info: DeviceInfo | None = None

    def close(self) -> None:
        self.port.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- frames ------------------------------------------------------------

    def write_raw(self, data: bytes) -> None:
        """Bytes straight onto the line (tests use this for garbage)."""
        self.port.write(data)
        self.port.flush()

    def read_packet(self) -> P.Packet:
        """The next frame from the device, decoded (empty frames skipped)."""
        while True:
            end = self._rx.find(b"\x00")
            if end >= 0:
                frame, self._rx = bytes(self._rx[:end]), self._rx[end + 1 :]
                if not frame:
                    continue
                if frame.startswith(b"FAULT"):  # the firmware's fault handler prints one plain line
                    raise DeviceError(f"device fault: {frame.decode('ascii', 'replace').strip()}")
                try:
                    return P.decode(frame)
                except P.FrameError as exc:
                    raise DeviceError(f"garbled frame from the device: {exc}") from None
            chunk = self.port.read(max(1, self.port.in_waiting))
            if not chunk:
                raise DeviceError(f"no answer from the device within {self.timeout} s")
            self._rx += chunk

    def send(self, ptype: int, payload: bytes = b"") -> int:
        self._seq = (self._seq + 1) % P.UNKNOWN_SEQ  # 0xFFFF is reserved for "unknown"
        self.write_raw(P.encode(P.Packet(ptype, self._seq, payload)))
        return self._seq

    def request(self, ptype: int, payload: bytes = b"") -> bytes:
        """Sends a request; returns the response payload, or raises DeviceError for a STATUS != 0."""
        name = P.Type(ptype).name if ptype in iter(P.Type) else f"type 0x{ptype:02x}"
        seq = self.send(ptype, payload)
        answer = self.read_packet()
        if answer.seq != seq:
            raise DeviceError(f"answer has seq {answer.seq}, expected {seq}")
        if answer.type == P.Type.STATUS:
            code, message = P.status_payload(answer)
            if code != 0:
                raise DeviceError(f"{name}: {P.status_name(code)} ({code}): {message}", code)
            return b""
        if answer.type != ptype | P.RESPONSE:
            raise DeviceError(f"{name}: unexpected answer type 0x{answer.type:02x}")
        return answer.payload

    # -- commands ----------------------------------------------------------

    def hello(self) -> Hello:
        p = self.request(P.Type.HELLO)
        version, max_payload, model_cap, arena_cap, kind = struct.unpack_from("<HHIIB", p)
        strings = p[struct.calcsize("<HHIIB") :].split(b"\x00")
        board, engine, flags = (s.decode() for s in (strings + [b"", b"", b""])[:3])
        return Hello(version, max_payload, model_cap, arena_cap, P.WorkKind(kind), board, engine, flags)

    def load(self, image: bytes, *, progress: bool = False) -> DeviceInfo:
        """Streams a model image into the device's RAM, checks its CRC there and initialises the engine."""
        from rich.progress import Progress

        self.request(P.Type.LOAD_BEGIN, struct.pack("<II", len(image), zlib.crc32(image)))
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("uploading model", total=len(image))
            for off in range(0, len(image), CHUNK):
                self.request(P.Type.LOAD_CHUNK, struct.pack("<I", off) + image[off : off + CHUNK])
                bar.advance(task, min(CHUNK, len(image) - off))
        self.request(P.Type.LOAD_END)
        self.info = self.model_info()
        return self.info

    def model_info(self) -> DeviceInfo:
        return DeviceInfo(*struct.unpack_from("<7I", self.request(P.Type.INFO)))

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, Work]:
        """Runs one batch on the device: x [batch, input_size] -> (y [batch, output_size], work)."""
        info = self.info or self.model_info()
        x = np.ascontiguousarray(x, dtype="<f4")
        if x.ndim != 2 or x.shape[1] != info.input_size:
            raise ValueError(f"input must be [batch, {info.input_size}], got {x.shape}")
        payload = self.request(P.Type.FORWARD, struct.pack("<I", x.shape[0]) + x.tobytes())
        batch, kind, count = struct.unpack_from("<IIQ", payload)
        y = np.frombuffer(payload, dtype="<f4", offset=16).reshape(batch, info.output_size)
        return y.astype(np.float32), Work(P.WorkKind(kind), count)

    def stats(self) -> Stats:
        return Stats(*struct.unpack_from("<5I", self.request(P.Type.STATS)))

    def reset(self) -> None:
        self.request(P.Type.RESET)
