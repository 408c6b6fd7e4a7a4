"""A client for the runner firmware over a serial port (pyserial).

    with Device("socket://127.0.0.1:4321") as dut:      # QEMU
    with Device("/dev/ttyACM0", baudrate=115200) as dut: # a board
        print(dut.hello())
        dut.load(image_bytes)          # into RAM, gone at reset
        dut.update(image_bytes)        # into the inactive flash slot, runs from there, survives reset
        y, work = dut.forward(x)
        logits, work = dut.forward_tokens([1, 2, 3])   # a token model: appends to its KV cache
        new_ids = dut.generate([1, 2, 3], 10, temperature=0.8, top_k=20, seed=7)  # sampled on the device
"""
from __future__ import annotations

import socket
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np
import serial

from . import protocol as P
from ..model.errors import ColibriError
from ..model.format import Status

CHUNK = P.MAX_PAYLOAD - 4  # LOAD_CHUNK and UPDATE_CHUNK carry a u32 offset
# UPDATE_BEGIN erases the target slot before it answers: on an STM32H743 a
# 128 KB sector takes about 2 s (4 s worst case), and a slot is 4 sectors.
ERASE_TIMEOUT = 30.0


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
    formats: tuple[int, int]  # (min, max) model image format versions the firmware's engine reads


@dataclass
class DeviceInfo:
    input_size: int
    output_size: int
    max_batch: int
    num_layers: int
    num_experts: int
    image_size: int
    arena_size: int
    vocab_size: int = 0  # a token model's (protocol 4); 0: a feature model
    max_seq_len: int = 0
    kv_cache_bytes: int = 0


@dataclass
class GenerationWork:
    """What GENERATE measured on the device: colibri_lm_forward over the prompt (prefill), over the
    fed-back tokens (decode, `decode_steps` one-token calls) and colibri_lm_sample over every draw."""

    kind: P.WorkKind
    prefill: int
    decode: int
    sample: int
    decode_steps: int

    @property
    def per_decode_step(self) -> float:
        """Work of one decode step: a one-token forward and a draw (the sampler runs once per token)."""
        if not self.decode_steps:
            return 0.0
        return self.decode / self.decode_steps + self.sample / (self.decode_steps + 1)


@dataclass
class Stats:
    stack_size: int
    stack_used: int
    model_capacity: int
    arena_capacity: int
    arena_used: int


@dataclass
class Slot:
    name: str  # "A" or "B"
    address: int
    state: P.SlotState
    sequence: int
    image_size: int
    image_crc32: int

    @property
    def valid(self) -> bool:
        return self.state == P.SlotState.VALID


@dataclass
class SlotInfo:
    slot_size: int
    sector_size: int
    program_size: int
    active: str | None  # the valid slot with the highest sequence: what boots
    running: str | None  # what the engine runs: "A", "B", "RAM" (a LOAD_* upload) or None
    updating: bool
    slots: list[Slot] = field(default_factory=list)

    def __getitem__(self, name: str) -> Slot:
        return self.slots["AB".index(name)]

    @property
    def capacity(self) -> int:
        return self.slot_size - 32


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
        self.last_generation: GenerationWork | None = None  # set by generate() and generate_text()
        self.last_prompt_ids = 0  # set by generate_text(): the ids its prompt encoded to

    def close(self) -> None:
        sock = getattr(self.port, "_socket", None)
        if sock is not None and self.port.is_open:
            # pyserial's socket:// close() sleeps 0.3 s "in case of quick reconnects"; a QEMU
            # serial port is never reopened, and the power-loss tests close a hundred of them.
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
            self.port._socket = None
            self.port.is_open = False
            return
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

    def request(self, ptype: int, payload: bytes = b"", *, timeout: float | None = None) -> bytes:
        """Sends a request; returns the response payload, or raises DeviceError for a STATUS != 0.

        `timeout` (seconds) replaces the port's for this one answer."""
        name = P.Type(ptype).name if ptype in iter(P.Type) else f"type 0x{ptype:02x}"
        seq = self.send(ptype, payload)
        if timeout is None:
            answer = self.read_packet()
        else:
            saved, saved_port = self.timeout, self.port.timeout
            self.timeout = self.port.timeout = timeout
            try:
                answer = self.read_packet()
            finally:
                self.timeout, self.port.timeout = saved, saved_port
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
        rest = p[struct.calcsize("<HHIIB") :]
        if version >= 2:
            formats = struct.unpack_from("<HH", rest)
            rest = rest[4:]
        else:
            formats = (1, 1)  # every protocol-1 runner read format 1 alone
        strings = rest.split(b"\x00")
        board, engine, flags = (s.decode() for s in (strings + [b"", b"", b""])[:3])
        return Hello(version, max_payload, model_cap, arena_cap, P.WorkKind(kind), board, engine, flags,
                     tuple(formats))

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
        p = self.request(P.Type.INFO)
        return DeviceInfo(*struct.unpack_from(f"<{min(len(p) // 4, 10)}I", p))  # 7 fields before protocol 4

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

    # -- token models (docs/lm.md) ---------------------------------------------

    def _token_model(self) -> DeviceInfo:
        info = self.info or self.model_info()
        if not info.vocab_size:
            raise DeviceError(f"MODEL_KIND ({int(Status.MODEL_KIND)}): the device runs a feature model",
                              int(Status.MODEL_KIND))
        return info

    @staticmethod
    def _ids(ids) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"token ids must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
        if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
            raise ValueError("token ids must fit int32")
        return arr.astype("<i4")

    def lm_reset(self) -> None:
        """Empties the device's KV cache: the next token is at position 0."""
        self.request(P.Type.LM_RESET)

    def forward_tokens(self, ids, *, last_only: bool = False) -> tuple[np.ndarray, Work]:
        """Appends ids to the device's sequence; returns (logits float32 [len(ids), vocab], or [1, vocab] with
        last_only, and the work of the forward calls summed). The ids go in calls of max_batch tokens, as
        colibri.LM.forward_tokens splits them, so the logits are the host engine's; when max_batch rows of
        logits do not fit a response frame (vocab x max_batch x 4 + 24 > MAX_PAYLOAD), every row needs calls
        of fewer tokens, which agree with the host within its tolerance but not bit for bit."""
        info = self._token_model()
        tokens = self._ids(ids)
        if not len(tokens):
            raise ValueError("forward_tokens needs at least one token id")
        chunk = info.max_batch
        if not last_only:
            fit = (P.MAX_PAYLOAD - P.FORWARD_TOKENS_RESPONSE.size) // (4 * info.vocab_size)
            if fit == 0:
                raise ValueError(f"one row of {info.vocab_size} logits does not fit a response frame; "
                                 "use last_only=True")
            chunk = min(chunk, fit)
        rows, total, kind = [], 0, P.WorkKind.NONE
        for start in range(0, len(tokens), chunk):
            part = tokens[start : start + chunk]
            mode = P.ROWS_LAST if last_only else P.ROWS_ALL
            payload = self.request(P.Type.FORWARD_TOKENS, P.FORWARD_TOKENS_REQUEST.pack(len(part), mode) + part.tobytes())
            n, nrows, _position, kind, count = P.FORWARD_TOKENS_RESPONSE.unpack_from(payload)
            rows.append(np.frombuffer(payload, "<f4", offset=P.FORWARD_TOKENS_RESPONSE.size)
                        .reshape(nrows, info.vocab_size))
            total += count
        logits = rows[-1] if last_only else np.concatenate(rows)
        return logits.astype(np.float32), Work(P.WorkKind(kind), total)

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0) -> list[int]:
        """colibri.LM.generate on the device: it resets its sequence, runs the prompt and draws
        max_new_tokens tokens with colibri_lm_sample and a SplitMix64 seeded with `seed`, all on the
        target; the same ids as colibri.LM.generate with the same arguments. The work it measured is
        in `self.last_generation`."""
        self._token_model()
        prompt = self._ids(prompt_ids)
        if not 0 <= max_new_tokens < 2**32:
            raise ValueError(f"max_new_tokens must be in 0..2^32-1, got {max_new_tokens}")
        if not 0 <= top_k < 2**32:
            raise ValueError(f"top_k must be in 0..2^32-1, got {top_k}")
        payload = self.request(P.Type.GENERATE, P.GENERATE_REQUEST.pack(
            max_new_tokens, temperature, top_k, top_p, int(seed) % 2**64, len(prompt)) + prompt.tobytes())
        count, kind, prefill, decode, sample = P.GENERATE_RESPONSE.unpack_from(payload)
        self.last_generation = GenerationWork(P.WorkKind(kind), prefill, decode, sample, max(count - 1, 0))
        return [int(t) for t in np.frombuffer(payload, "<i4", count, offset=P.GENERATE_RESPONSE.size)]

    def generate_text(self, prompt: str | list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True) -> tuple[str, list[int]]:
        """GENERATE_TEXT (protocol 5): `generate` with the image's own tokenizer on the device. A str
        prompt is encoded there (colibri_tokenizer_encode; the same ids as colibri.LM.encode), a list
        of ids goes as it is; the tokenizer's EOS ends the run unless stop_at_eos=False; the new ids
        come back with their text, decoded on the device by its streaming decoder. Returns (text,
        new ids); the prompt's id count is in `self.last_prompt_ids`."""
        self._token_model()
        if not 0 <= max_new_tokens < 2**32:
            raise ValueError(f"max_new_tokens must be in 0..2^32-1, got {max_new_tokens}")
        if not 0 <= top_k < 2**32:
            raise ValueError(f"top_k must be in 0..2^32-1, got {top_k}")
        flags = P.GENERATE_TEXT_STOP_AT_EOS if stop_at_eos else 0
        if isinstance(prompt, str):
            body = prompt.encode("utf-8", "surrogatepass")
            flags |= P.GENERATE_TEXT_PROMPT_TEXT
            count = len(body)
        else:
            ids = self._ids(prompt)
            body, count = ids.tobytes(), len(ids)
        payload = self.request(P.Type.GENERATE_TEXT, P.GENERATE_TEXT_REQUEST.pack(
            max_new_tokens, temperature, top_k, top_p, int(seed) % 2**64, flags, count) + body)
        made, kind, prefill, decode, sample, prompt_ids, text_len = P.GENERATE_TEXT_RESPONSE.unpack_from(payload)
        self.last_generation = GenerationWork(P.WorkKind(kind), prefill, decode, sample, max(made - 1, 0))
        self.last_prompt_ids = prompt_ids
        at = P.GENERATE_TEXT_RESPONSE.size
        new = [int(t) for t in np.frombuffer(payload, "<i4", made, offset=at)]
        text = payload[at + 4 * made : at + 4 * made + text_len].decode("utf-8")  # whole characters by design
        return text, new

    def kernels(self, reference: bool | None = None) -> tuple[bool, str]:
        """Selects the device's kernels (reference=True: the reference kernels, the specification, which
        match the host's `colibri.Model(img, reference_kernels=True)` bit for bit; False: the build's
        optimised ones, the default) for the running model and every model loaded after, until reset;
        None only asks. Returns (reference selected, the running model's kernel name or "")."""
        payload = b"" if reference is None else struct.pack("<I", P.KERNELS_REFERENCE if reference
                                                             else P.KERNELS_OPTIMISED)
        p = self.request(P.Type.KERNELS, payload)
        (which,) = struct.unpack_from("<I", p)
        return which == P.KERNELS_REFERENCE, p[4:].decode("ascii", "replace")

    def stats(self) -> Stats:
        return Stats(*struct.unpack_from("<5I", self.request(P.Type.STATS)))

    def reset(self) -> None:
        self.request(P.Type.RESET)

    # -- model slots in flash ------------------------------------------------

    def slot_info(self) -> SlotInfo:
        """Both flash slots as the device reads them now, which one is active and what runs."""
        p = self.request(P.Type.SLOT_INFO)
        slot_size, sector_size, program_size, active, running, updating, _ = P.SLOT_INFO.unpack_from(p)
        slots = []
        for i in range(2):
            address, state, _, _, sequence, size, crc = P.SLOT_ENTRY.unpack_from(p, P.SLOT_INFO.size + i * P.SLOT_ENTRY.size)
            slots.append(Slot("AB"[i], address, P.SlotState(state), sequence, size, crc))
        names = {0: "A", 1: "B", P.RUNNING_RAM: "RAM", P.RUNNING_BUILTIN: "built-in"}
        return SlotInfo(slot_size, sector_size, program_size, names.get(active), names.get(running), bool(updating),
                        slots)

    def update(self, image: bytes, *, progress: bool = False, crc: int | None = None) -> SlotInfo:
        """Writes a model image into the flash slot that does not run and switches to it.

        UPDATE_BEGIN erases the slot, UPDATE_CHUNKs program it, UPDATE_COMMIT checks the image CRC in
        flash and commits it with one header word; the device then runs it, and boots it from now on.
        A power loss before the commit leaves the old model. `crc` overrides the announced CRC-32
        (tests). Returns SLOT_INFO after the commit."""
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, \
            TransferSpeedColumn

        announced = zlib.crc32(image) if crc is None else crc
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn())
        console = Console(stderr=True)  # stdout stays for results
        with Progress(*columns, console=console, disable=not (progress and console.is_terminal),
                      transient=True) as bar:
            task = bar.add_task("erasing slot", total=len(image))
            self.request(P.Type.UPDATE_BEGIN, struct.pack("<II", len(image), announced),
                         timeout=max(self.timeout, ERASE_TIMEOUT))
            bar.update(task, description="programming")
            for off in range(0, len(image), CHUNK):
                self.request(P.Type.UPDATE_CHUNK, struct.pack("<I", off) + image[off : off + CHUNK])
                bar.advance(task, min(CHUNK, len(image) - off))
            bar.update(task, description="verifying")
            self.request(P.Type.UPDATE_COMMIT)
        self.info = self.model_info()
        return self.slot_info()

    def power_cut_after(self, n: int, mode: int = 0, tear: int = 0) -> int:
        """Debug (emulated boards): the power fails after n more flash operations, cleanly (mode 0)
        or half way through the n-th (mode 1; `tear` = bytes of a sector erased, or mask of the
        word's bytes programmed). Returns the flash operations done since reset."""
        (done,) = struct.unpack("<I", self.request(P.Type.POWER_CUT_AFTER, struct.pack("<III", n, mode, tear)))
        return done
