"""`colibri.Model`: the C engine from CPython."""
from __future__ import annotations

import errno
import operator
import os
import stat
import threading
import warnings
from collections.abc import Callable, Iterator

import numpy as np

from . import _engine, sources
from ..model.errors import ColibriError, error_for
from ..model.format import TOKENIZER_VERSION, Status
from ..image.codecs import total_size
from ..model.ir import Expert, F16Weight, Q4Weight, Q8Weight
from ..model.sampler import check_sampler, integer_arg
from .sources import StaleEngineError  # noqa: F401  (raised on import in a checkout whose C changed)

# Tests run through this binding: in a checkout, a binary built from older C sources must not pass them.
sources.check_binding(_engine)


def _call(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except _engine.EngineError as exc:
        status = exc.args[0]
        raise error_for(status) from None


CHECK_FULL, CHECK_STRUCTURE = 0, 1  # COLIBRI_CHECK_*
VERIFY = {"on_use": 0, "full": 1, "none": 2}  # COLIBRI_VERIFY_* (posix/colibri_file.h)
LOCK = {None: 0, "none": 0, "all": 1, "dense": 3}  # COLIBRI_LOCK_*; a list of (layer, expert) is COLIBRI_LOCK_EXPERTS


class ModelFile:
    """A model file mapped by the POSIX layer (`open_file`); `raw` is the binding's object, a
    read-only buffer over the mapping. Every method raises the engine's errors as ColibriError."""

    def __init__(self, raw: "_engine.File", path: str):
        self.raw, self.path = raw, path

    def will_need(self, layer: int, experts) -> None:
        """Asks the kernel to read these experts' missing pages, in requests it carries out whole, without
        waiting (and checks their CRCs on first use with verify="on_use", which reads them)."""
        _call(self.raw.will_need, layer, list(experts))

    def verify(self) -> None:
        """Every payload against its CRC now (reads the whole file)."""
        _call(self.raw.verify)

    def verify_expert(self, layer: int, expert: int) -> None:
        _call(self.raw.verify_expert, layer, expert)

    def expert_range(self, layer: int, expert: int) -> tuple[int, int]:
        """(offset, size) of the expert's payloads in the image."""
        return _call(self.raw.expert_range, layer, expert)

    def experts(self) -> list[int]:
        """Expert slots (routed, then shared) of each MoE layer."""
        return self.raw.experts()

    def check(self) -> int:
        """0, or Status.FILE_CHANGED once the file was truncated or extended in place."""
        return self.raw.check()

    def replaced(self) -> bool:
        """Whether the path now names another file (replaced by rename: reopen to pick it up)."""
        return self.raw.replaced()

    def resident(self) -> int:
        """Bytes of the mapping resident in memory now (mincore)."""
        return self.raw.resident()

    def set_ahead(self, stages: int) -> None:
        """How many stages past the MoE layer being routed the route callback advises in (colibri_file_set_ahead;
        default 1, 0 off): the attention, norms, router and shared experts of the next MoE layers, the head."""
        _call(self.raw.set_ahead, operator.index(stages))

    def advice(self) -> dict[str, int]:
        """The advice so far (colibri_file_advice_counts): the experts routing selected (route_calls,
        route_bytes) and the stages ahead's ranges (ahead_calls, ahead_bytes), as asked; route_advised and
        ahead_advised the bytes requested from the kernel (the pages mincore said were not resident);
        requests the read-ahead calls made (open's and mlock's included), each of at most request_bytes."""
        names = ("route_calls", "route_bytes", "ahead_calls", "ahead_bytes", "route_advised", "ahead_advised",
                 "requests", "request_bytes")
        return dict(zip(names, _call(self.raw.advice)))

    def set_request_bytes(self, nbytes: int) -> None:
        """The most one read-ahead request asks for (colibri_file_set_request_bytes; whole pages). Open reads
        the device's limit from sysfs: Linux reads no more of one request than that."""
        _call(self.raw.set_request_bytes, operator.index(nbytes))

    def ahead_ranges(self, stage: int) -> list[tuple[int, int]]:
        """The page ranges (start, end) the advice ahead covers for stage 0..len(experts())."""
        return _call(self.raw.ahead_ranges, stage)

    def close(self) -> None:
        """Unmaps; BufferError while a Model or memoryview still reads the mapping."""
        self.raw.close()

    def __len__(self) -> int:
        return memoryview(self.raw).nbytes


def open_file(path: str | os.PathLike, *, verify: str = "on_use", lock=None) -> ModelFile:
    """Maps a model file through the POSIX layer (firmware/colibri_core/posix/colibri_file.h): structural
    validation, mmap read-only, MADV_RANDOM, the lock and verify options. Raises ModelFileError
    (file missing, unreadable, mmap failed, mlock refused: the message gives RLIMIT_MEMLOCK) or ImageError."""
    if verify not in VERIFY:
        raise ValueError(f"verify must be one of {', '.join(VERIFY)}, got {verify!r}")
    experts = None
    if isinstance(lock, str) or lock is None:
        if lock not in LOCK:
            raise ValueError(f"lock must be None, 'all', 'dense', 'none' or a list of (layer, expert), got {lock!r}")
        mode = LOCK[lock]
    else:
        mode, experts = 2, [(int(layer), int(e)) for layer, e in lock]
    try:
        return ModelFile(_engine.File(os.fspath(path), VERIFY[verify], mode, experts), os.fspath(path))
    except _engine.EngineError as exc:
        status, _, err, limit, want, layer, expert = exc.args
        detail = f"{path}"
        if err == errno.ENODEV:
            detail += f": not a regular file ({_file_kind(path)})"
        elif err:
            detail += f": {os.strerror(err)}"
        if status == int(Status.MLOCK_FAILED):
            lim = "unlimited" if limit == 2**64 - 1 else f"{limit:,} bytes"
            detail += f"; RLIMIT_MEMLOCK is {lim}, {want:,} bytes asked (raise it: ulimit -l, or LimitMEMLOCK= in systemd)"
        elif status in (int(Status.NO_SUCH_EXPERT), int(Status.BAD_PAYLOAD_CRC)) and (layer or expert):
            detail += f" (MoE layer {layer}, expert {expert})"
        raise error_for(status, detail) from None


def _file_kind(path) -> str:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "gone"
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a directory" if stat.S_ISDIR(mode) else "not a regular file")


def read_model_file(path: str | os.PathLike) -> bytes:
    """The bytes of a model file, as the POSIX layer opens one: non-blocking, so a FIFO or a device
    cannot stall the caller waiting for a writer, and anything but a regular file is refused
    (ModelFileError, FILE_OPEN) before a byte is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error_for(Status.FILE_NOT_FOUND, os.fspath(path)) from None
    except OSError as exc:
        raise error_for(Status.FILE_OPEN, f"{os.fspath(path)}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else
                    "a socket" if stat.S_ISSOCK(st.st_mode) else "a device")
            raise error_for(Status.FILE_OPEN, f"{os.fspath(path)}: not a regular file ({kind})")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    finally:
        os.close(fd)


def _open_pinned(path, verify: str, lock, lock_required: bool) -> tuple[ModelFile, Exception | None]:
    """open_file; with lock_required=False, an mlock the system refuses (RLIMIT_MEMLOCK) opens the file
    unpinned instead, with a warning: (file, the refusal or None)."""
    try:
        return open_file(path, verify=verify, lock=lock), None
    except ColibriError as exc:
        if lock_required or lock is None or lock == "none" or exc.status != Status.MLOCK_FAILED:
            raise
        warnings.warn(f"{exc}; serving unpinned (lock_required=False)", RuntimeWarning, stacklevel=4)
        return open_file(path, verify=verify), exc


def _open(source, reference_kernels: bool, copy: bool, verify: str, lock, advise: bool, workers: int = 1,
          ahead: int = 1, lock_required: bool = True):
    """(mapping or None, image buffer, engine context, mlock refusal or None) for a path (mapped unless
    copy) or bytes; workers > 1: the context's arena and thread pool serve that many (token models)."""
    if isinstance(source, (str, os.PathLike)) and not copy:
        file, refused = _open_pinned(source, verify, lock, lock_required)
        file.set_ahead(ahead)
        return file, memoryview(file.raw), _call(_engine.Context, file.raw, reference_kernels, CHECK_STRUCTURE, advise,
                                                 workers), refused
    if lock is not None:
        raise ValueError("lock applies to a mapped file: pass the path, without copy=True")
    if isinstance(source, (str, os.PathLike)):
        source = read_model_file(source)
    image = bytes(source)
    return None, image, _call(_engine.Context, image, reference_kernels, workers=workers), None


class ExpertCall:
    """One expert over a ring of tokens, as the engine offers it to the accelerator hook
    (colibri_expert_call, include/colibri.h). Nothing is copied: `spec` is the image's expert
    record with its weights as numpy views of the image (`w1`, `w2`, `w3`: float32 arrays,
    `F16Weight`, `Q8Weight` or `Q4Weight` (its `q` unpacked, `packed` the view) with its companion's scales, bias and compensation; `b1`..`b3`;
    `kind`, `act`, `int8_act`), `x` [rows, d] and `y` [rows, d] (writable) are the engine's rows.
    The hook adds, for i < n, gate[i] · expert(x[x_rows[i]]) into y[y_rows[i]] (an index list
    None meaning 0 .. n-1, gate None meaning 1). The views are valid during the call only."""

    def __init__(self, layer: int, record: int, spec: Expert, d: int, hidden: int, n: int, x, x_rows, gate, y,
                 y_rows):
        self.layer, self.expert, self.spec, self.d, self.hidden, self.n = layer, record, spec, d, hidden, n
        self.x = np.frombuffer(x, dtype=np.float32).reshape(-1, d)
        self.y = np.frombuffer(y, dtype=np.float32).reshape(-1, d)
        self.x_rows = None if x_rows is None else np.frombuffer(x_rows, dtype=np.uint16)
        self.y_rows = None if y_rows is None else np.frombuffer(y_rows, dtype=np.uint16)
        self.gate = None if gate is None else np.frombuffer(gate, dtype=np.float32)

    _ROWS = ("x", "y", "x_rows", "y_rows", "gate")

    def _end(self) -> None:
        """The call returned: the engine's rows are gone from this object (reading one raises);
        the binding has released its views of them."""
        for name in self._ROWS:
            self.__dict__.pop(name, None)

    def __getattr__(self, name: str):
        if name in ExpertCall._ROWS:
            raise ValueError(f"ExpertCall.{name} is valid during the call only: the engine's rows are lent "
                             f"for the hook's call, not kept (docs/accelerator.md)")
        raise AttributeError(name)

    def __repr__(self) -> str:
        return (f"ExpertCall(layer={self.layer}, expert={self.expert}, {self.spec.kind.name} {self.spec.act.name}, "
                f"d={self.d}, hidden={self.hidden}, n={self.n})")


def _experts_by_w1(image) -> dict[int, Expert]:
    """Every expert record of an image keyed by its w1 payload's byte offset, which the engine's
    hook call carries: the structure is read once, the weights stay views of the image."""
    from ..image import read

    base = np.frombuffer(image, dtype=np.uint8).ctypes.data
    out: dict[int, Expert] = {}
    for moe in read(image, check="structure").moe_layers():
        for e in (*moe.experts, *moe.shared):
            w1 = (e.w1.q if isinstance(e.w1, Q8Weight) else e.w1.packed if isinstance(e.w1, Q4Weight)
                  else e.w1.data if isinstance(e.w1, F16Weight) else e.w1)
            out[w1.ctypes.data - base] = e
    return out


class Model:
    """A model image run by the C engine.

    `Model(path_or_bytes)` validates the image and allocates the arena once;
    `forward(x)` maps `[batch, input_size]` float32 to `[batch, output_size]`.
    Batches larger than the image's `max_batch` are run in chunks.

    `reference_kernels=True` runs the reference kernels (the specification,
    the same bits on every target and as `colibri.reference`) instead of the
    build's optimised backend; `kernels` names the ones in use.

    A path is mapped, not copied (the POSIX layer, as libcolibri's users):
    opening validates the structure and reads no weights; `verify` says when
    payloads are checked against their CRCs (format v3: per tensor):
    "on_use" (default: each expert when routing first selects it, through
    the engine's on_route callback, with MADV_WILLNEED), "full" (at open) or
    "none" (`Model.file.verify()` on demand); `advise=False` (with "full"
    or "none") runs without the route callback (no MADV_WILLNEED, for the
    bench's comparison); `ahead` is how many stages past the routed layer
    the callback advises in (`ModelFile.set_ahead`: the next layers' dense
    tensors and shared experts; 0 off); `lock` pins pages: "all" or a
    list of (moe_layer, expert), or "dense" (every tensor that is no expert's:
    embeddings, attention, norms, routers, the head), and `lock_required=False` serves unpinned,
    with a RuntimeWarning and the refusal in `lock_error`, when the system
    refuses the mlock (RLIMIT_MEMLOCK). `model.file` is the mapping (`will_need`,
    `resident`, `check`, `replaced`, `advice`). A file replaced by rename keeps serving
    the old mapping; a new Model(path) maps the new one. To copy the file
    into memory instead, pass `copy=True` (or the bytes themselves).
    """

    def __init__(self, source: str | os.PathLike | bytes | bytearray | memoryview,
                 reference_kernels: bool = False, *, copy: bool = False, verify: str = "on_use", lock=None,
                 advise: bool = True, ahead: int = 1, lock_required: bool = True):
        if not advise and verify == "on_use":
            raise ValueError("advise=False skips the route callback that verifies on use: verify='full' or 'none'")
        self.file, self.image, self._ctx, self.lock_error = _open(source, reference_kernels, copy, verify, lock, advise,
                                                                  ahead=ahead, lock_required=lock_required)
        self.kernels: str = self._ctx.kernels()
        info = self._ctx.info()
        # colibri_model_info.image_size is the header's u32 field: 0xFFFFFFFF for a version-7 image past it
        info["image_size"] = total_size(self.image)
        if info["vocab_size"]:
            raise error_for(Status.MODEL_KIND, "a token model (token ids in, logits out): open it with colibri.LM")
        self.info: dict[str, int] = info
        self.input_size: int = info["input_size"]
        self.output_size: int = info["output_size"]
        self.max_batch: int = info["max_batch"]
        self.num_experts: int = info["num_experts"]
        self.num_parameters: int = info["num_parameters"]
        self.arena_size: int = info["arena_size"]
        self.image_size: int = info["image_size"]
        self._experts_by_w1: dict[int, Expert] | None = None  # read on the first forward with an expert hook

    def forward(self, x: np.ndarray, on_route: Callable[[int, list[int], list[int]], object] | None = None,
                expert: Callable[[ExpertCall], bool] | None = None) -> np.ndarray:
        """Runs the rows of x ([batch, input_size] or one row). on_route, if given, is called for each
        MoE layer after routing and before its experts run (colibri_forward_ex): on_route(layer,
        experts, tokens) with the expert records about to run (routed ones that got tokens, then the
        shared ones) and each one's token count; an exception it raises stops the pass and propagates.
        expert, if given, is the accelerator hook (docs/accelerator.md): expert(call) for each expert
        about to run, with a `ExpertCall` of the image's weights and the engine's rows in place; it
        returns True once it has added the expert's gated output into call.y, False to have the
        engine run that expert; an exception it raises stops the pass and propagates.
        Batches beyond max_batch run in chunks, each calling on_route (and expert) again."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        single = x.ndim == 1
        if single:
            x = x[None, :]
        if x.ndim != 2 or x.shape[1] != self.input_size:
            raise ValueError(f"input must be [batch, {self.input_size}], got shape {x.shape}")
        out = np.empty((x.shape[0], self.output_size), dtype=np.float32)
        for start in range(0, x.shape[0], self.max_batch):
            chunk = x[start : start + self.max_batch]
            if on_route is None and expert is None:
                _call(self._ctx.forward, chunk, out[start : start + len(chunk)], len(chunk))
            else:
                hook = None if expert is None else self._expert_hook(expert)
                _call(self._ctx.forward_ex, chunk, out[start : start + len(chunk)], len(chunk), on_route, hook)
        return out[0] if single else out

    __call__ = forward

    def _expert_hook(self, expert: Callable[[ExpertCall], bool]):
        """The binding's raw hook (payload offsets, memoryviews) as expert(ExpertCall)."""
        if not callable(expert):
            raise TypeError(f"expert must be callable, got {type(expert).__name__}")
        if self._experts_by_w1 is None:
            self._experts_by_w1 = _experts_by_w1(self.image)

        def hook(layer, record, kind, act, d, hidden, offsets, n, x, x_rows, gate, y, y_rows) -> bool:
            spec = self._experts_by_w1[offsets[0]]
            call = ExpertCall(layer, record, spec, d, hidden, n, x, x_rows, gate, y, y_rows)
            try:
                return bool(expert(call))
            finally:
                call._end()

        return hook

    def __repr__(self) -> str:
        return (
            f"colibri.Model(in={self.input_size}, out={self.output_size}, experts={self.num_experts}, "
            f"max_batch={self.max_batch}, image={self.image_size} B, arena={self.arena_size} B)"
        )


class LM:
    """A token model (MoE language model, docs/lm.md) run by the C engine.

    `LM(path_or_bytes)` validates the image and allocates the arena, its KV cache of
    `max_seq_len` positions included. `forward_tokens(ids)` appends the ids to the sequence
    and returns their logits `[len(ids), vocab]` (float32), in chunks of `max_batch`;
    `reset()` starts a new sequence; `position` is the number of positions cached.
    `generate(prompt_ids, max_new_tokens, ...)` starts a new sequence with the prompt and
    returns the new token ids, sampled in C (greedy at temperature 0, else temperature,
    top-k and top-p with a SplitMix64 seeded by `seed`): `reference.LMState` draws the same.
    `reference_kernels=True` runs the reference kernels, as `Model`. A path is mapped, not
    copied, as by `Model`: opening checks the structure (header, tables, references) and, with the
    default `verify="on_use"`, the payloads every token reads (embeddings, attention, norms, routers,
    the head) against their CRCs; each expert's payloads are checked when routing first selects it
    (BAD_PAYLOAD_CRC stops that forward), its pages advised in (MADV_WILLNEED) with the next stages'
    (`ahead`, as `Model`). `verify="full"` checks every payload at open (reads the whole file),
    `"none"` none (`LM.file.verify()` on demand); `advise=False` (with "full" or "none") runs without
    the route callback. `lock` and `lock_required` pin pages as `Model`'s. `copy=True` reads the file
    into memory instead.
    `workers=N` (N > 1) runs each forward on N threads (colibri_lm_forward_ex over a colibri_pool,
    the caller's thread one of them): the same logits, bit for bit, and so the same ids; the
    arena grows by colibri_model_size_ex's per-worker scratch (`arena_size`).
    """

    def __init__(self, source: str | os.PathLike | bytes | bytearray | memoryview, reference_kernels: bool = False,
                 *, copy: bool = False, verify: str = "on_use", lock=None, workers: int = 1, advise: bool = True,
                 ahead: int = 1, lock_required: bool = True):
        if not advise and verify == "on_use":
            raise ValueError("advise=False skips the route callback that verifies on use: verify='full' or 'none'")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive int, got {workers!r}")
        self.file, self.image, self._ctx, self.lock_error = _open(source, reference_kernels, copy, verify, lock, advise,
                                                                  workers, ahead, lock_required)
        self.kernels: str = self._ctx.kernels()
        self.workers: int = workers
        info = self._ctx.info()
        # colibri_model_info.image_size is the header's u32 field: 0xFFFFFFFF for a version-7 image past it
        info["image_size"] = total_size(self.image)
        if not info["vocab_size"]:
            raise error_for(Status.MODEL_KIND, "a feature model (float rows in): open it with colibri.Model")
        self.info: dict[str, int] = info
        self.vocab_size: int = info["vocab_size"]
        self.max_seq_len: int = info["max_seq_len"]
        self.max_batch: int = info["max_batch"]
        self.arena_size: int = self._ctx.arena_size()
        self.kv_cache_bytes: int = info["kv_cache_bytes"]
        # One sequence, so one change to it at a time: every call that changes it (reset,
        # forward_tokens, generate, a stream's step) holds this lock and bumps _epoch; a stream
        # refuses to go on once anything else changed its sequence (docs/threading.md).
        self._sequence_lock = threading.Lock()
        self._epoch = 0
        # The image's tokenizer section (format v6, docs/lm.md), read by the C engine: its
        # special ids; the host tokenizer (tokenizers / sentencepiece) is built on first use.
        self._tokenizer_info: dict | None = None
        if int.from_bytes(self.image[4:6], "little") >= TOKENIZER_VERSION:  # older images have none
            try:
                self._tokenizer_info = _engine.TextDecoder(self.image).info()
            except _engine.EngineError as e:
                if e.args[0] != Status.NO_TOKENIZER:
                    raise error_for(e.args[0]) from None
        self._host_tokenizer = None
        self._device_encoder = None

    @property
    def has_tokenizer(self) -> bool:
        """Whether the image carries a tokenizer section (format v6)."""
        return self._tokenizer_info is not None

    @property
    def eos(self) -> int | None:
        """The end-of-sequence id of the image's tokenizer, None without one (or without EOS)."""
        info = self._tokenizer_info
        return None if info is None or info["eos"] < 0 else info["eos"]

    @property
    def bos(self) -> int | None:
        info = self._tokenizer_info
        return None if info is None or info["bos"] < 0 else info["bos"]

    def _need_tokenizer(self) -> None:
        if self._tokenizer_info is None:
            raise error_for(Status.NO_TOKENIZER, "export the model with its tokenizer (colibri export DIR keeps the "
                                                 "folder's), or tokenize outside (colibri.runtime.tokenizer)")

    @property
    def tokenizer(self):
        """The image's tokenizer on the host (`runtime.tokenizer_build.SectionTokenizer`: the `tokenizers` or
        `sentencepiece` library rebuilt from the section); NO_TOKENIZER without a section."""
        self._need_tokenizer()
        if self._host_tokenizer is None:
            from ..image.tokenizer_section import find, parse
            from .tokenizer_build import SectionTokenizer

            self._host_tokenizer = SectionTokenizer(parse(find(self.image), self.vocab_size))
        return self._host_tokenizer

    def encode(self, text: str) -> list[int]:
        """Text to ids with the image's tokenizer (on the host, by its library; no BOS added)."""
        return self.tokenizer.encode(text)

    def encode_device(self, text: str) -> list[int]:
        """Text to ids by the C engine's encoder (colibri_tokenizer_encode), as a device encodes it: the
        same ids as `encode`, or the engine's error for what a device refuses (BAD_TEXT,
        TEXT_NOT_NORMALIZED for an NFC tokenizer and text NFC may change, UNSUPPORTED for a section
        written before encoding)."""
        self._need_tokenizer()
        if self._device_encoder is None:
            self._device_encoder = _engine.TextDecoder(self.image)
        try:
            # a lone surrogate goes through as the bytes it would be, which the device refuses as BAD_TEXT
            return self._device_encoder.encode(text.encode("utf-8", "surrogatepass"))
        except _engine.EngineError as e:
            raise error_for(e.args[0], f"encoding {text[:40]!r}") from None

    def text_stream(self) -> "TextStream":
        """The C engine's streaming decoder over the image's tokenizer: `push(id)` returns the text
        that token completes (a character split across tokens comes out whole), `flush()` the rest."""
        self._need_tokenizer()
        return TextStream(self.image)

    def decode(self, ids) -> str:
        """Ids to text by the C engine's decoder (colibri_tokenizer_decode), as a device prints it."""
        stream = self.text_stream()
        return "".join(stream.push(int(i)) for i in ids) + stream.flush()

    @property
    def position(self) -> int:
        """Positions in the KV cache: the next token's position."""
        return _call(self._ctx.lm_position)

    def reset(self) -> None:
        """Empties the KV cache: the next token is at position 0."""
        with self._sequence_lock:
            _call(self._ctx.lm_reset)
            self._epoch += 1

    def _ids(self, ids, what: str) -> np.ndarray:
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"{what} must be a 1-D sequence of integer token ids, got {arr.dtype} of shape {arr.shape}")
        bad = (arr < 0) | (arr >= self.vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise error_for(Status.BAD_TOKEN, f"{what}[{i}] = {int(arr[i])} is outside the vocabulary 0..{self.vocab_size - 1}")
        return np.ascontiguousarray(arr, dtype=np.int32)

    def _room(self, needed: int) -> None:
        if self.position + needed > self.max_seq_len:
            raise error_for(Status.CACHE_FULL, f"{self.position} positions cached + {needed} > max_seq_len "
                                               f"{self.max_seq_len} (reset() starts a new sequence)")

    def forward_tokens(self, ids, on_route: Callable[[int, list[int], list[int]], object] | None = None) -> np.ndarray:
        """Appends ids to the sequence; returns their logits, float32 [len(ids), vocab]. Nothing is
        appended if any id is outside the vocabulary or the cache cannot hold them all. on_route, as
        `Model.forward`'s: on_route(layer, experts, tokens) for each MoE layer of each chunk, after its
        routing and before its experts run (a mapped file's advice and verification first)."""
        tokens = self._ids(ids, "ids")
        with self._sequence_lock:
            return self._forward_locked(tokens, on_route)

    def _forward_locked(self, tokens: np.ndarray, on_route=None) -> np.ndarray:
        self._room(len(tokens))
        out = np.empty((len(tokens), self.vocab_size), dtype=np.float32)
        for start in range(0, len(tokens), self.max_batch):
            chunk = tokens[start : start + self.max_batch]
            _call(self._ctx.lm_forward, chunk, out[start : start + len(chunk)], len(chunk), on_route)
        self._epoch += 1
        return out

    def _check_generation(self, prompt_ids, max_new_tokens: int, temperature: float, top_k: int,
                          top_p: float, seed: int) -> np.ndarray:
        check_sampler(temperature, top_k, top_p)
        max_new_tokens = integer_arg("max_new_tokens", max_new_tokens)
        integer_arg("seed", seed)
        prompt = self._ids(prompt_ids, "prompt_ids")
        if len(prompt) == 0:
            raise error_for(Status.BAD_BATCH, "an empty prompt: give at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if len(prompt) + max(max_new_tokens - 1, 0) > self.max_seq_len:
            raise error_for(Status.CACHE_FULL, f"{len(prompt)} prompt tokens + {max_new_tokens} new ones need "
                                               f"{len(prompt) + max_new_tokens - 1} positions, max_seq_len is "
                                               f"{self.max_seq_len}")
        return prompt

    def _stop(self, stop) -> int | None:
        """`stop="eos"`: the image tokenizer's EOS (None without one); None; or an id."""
        if isinstance(stop, str):
            if stop != "eos":
                raise ValueError(f"stop must be 'eos', None or a token id, got {stop!r}")
            return self.eos
        return None if stop is None else operator.index(stop)

    def stream(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop: int | str | None = "eos") -> Iterator[int]:
        """`generate` one token at a time: yields each new id as soon as it is drawn, the same ids
        `generate` returns (the same checks, all made before the first token; the same C sampler and
        SplitMix64 state, carried from draw to draw). `stop`: an id that ends the stream once
        yielded; "eos" (the default) is the image tokenizer's end-of-sequence id, if it has one.
        The loop runs in Python, one C call a token."""
        prompt = self._check_generation(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed)
        return self._stream(prompt, operator.index(max_new_tokens), float(temperature), operator.index(top_k),
                            float(top_p), operator.index(seed) % 2**64, self._stop(stop))

    def _stream_step(self, epoch: int | None, tokens: np.ndarray) -> tuple[np.ndarray, int]:
        """One step of a stream under the sequence lock: (last row's logits, the new epoch). epoch
        None starts the sequence (a reset first); otherwise the sequence must be as the stream left it."""
        with self._sequence_lock:
            if epoch is None:
                _call(self._ctx.lm_reset)
            elif epoch != self._epoch:
                raise RuntimeError("LM.stream: another call (reset, forward_tokens, generate or another stream) "
                                   "changed this LM's sequence since the stream's last token; one LM holds one "
                                   "sequence (docs/threading.md): use an LM per concurrent stream")
            logits = self._forward_locked(tokens)[-1]
            return logits, self._epoch

    def _stream(self, prompt: np.ndarray, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                state: int, stop: int | None) -> Iterator[int]:
        if max_new_tokens == 0:
            self.reset()
            return
        logits, epoch = self._stream_step(None, prompt)
        for made in range(1, max_new_tokens + 1):
            token, state = _call(self._ctx.lm_sample, logits, temperature, top_k, top_p, state)
            yield token
            if made == max_new_tokens or token == stop:
                return
            logits, epoch = self._stream_step(epoch, np.array([token], dtype=np.int32))

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop: int | str | None = "eos") -> list[int]:
        """Resets, feeds the prompt in chunks of max_batch, then draws max_new_tokens tokens from the
        last row's logits, each fed back but the last; the loop runs in C (reference.LMState.generate
        is its twin: the same checks in the same order, the same draws). `stop` ends it early once
        that id is drawn (it is the last id returned): "eos" (the default) is the image tokenizer's
        end-of-sequence id, so an image with a tokenizer stops at its EOS; None never stops early."""
        stop_id = self._stop(stop)
        prompt = self._check_generation(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed)
        # One lock over the whole generation (lm_generate resets, then runs the loop in C): a
        # reset() or forward_tokens() from another thread waits for it instead of cutting in.
        with self._sequence_lock:
            self._epoch += 1
            if operator.index(max_new_tokens) == 0:
                _call(self._ctx.lm_reset)
                return []
            return _call(self._ctx.lm_generate, prompt, operator.index(max_new_tokens), float(temperature),
                         operator.index(top_k), float(top_p), operator.index(seed) % 2**64,
                         -1 if stop_id is None else stop_id)

    def generate_text(self, prompt: str, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                      top_p: float = 1.0, seed: int = 0, stop: int | str | None = "eos") -> str:
        """Text in, text out with the image's tokenizer: the prompt encoded on the host, the
        continuation generated (ending at EOS by default) and decoded by the C engine."""
        ids = self.encode(prompt)
        return self.decode(self.generate(ids, max_new_tokens, temperature, top_k, top_p, seed, stop))

    def __repr__(self) -> str:
        return (f"colibri.LM(vocab={self.vocab_size}, max_seq_len={self.max_seq_len}, max_batch={self.max_batch}, "
                f"arena={self.arena_size} B, kv_cache={self.kv_cache_bytes} B, workers={self.workers}, "
                f"position={self.position})")


class TextStream:
    """The C engine's streaming decoder (colibri_tokenizer_decode) over an image's tokenizer."""

    def __init__(self, image) -> None:
        try:
            self._decoder = _engine.TextDecoder(image)
        except _engine.EngineError as e:
            raise error_for(e.args[0]) from None

    def push(self, token: int) -> str:
        """The text token `token` completes (whole UTF-8 characters only)."""
        try:
            return self._decoder.push(operator.index(token)).decode("utf-8")
        except _engine.EngineError as e:
            raise error_for(e.args[0], f"token {token}") from None

    def flush(self) -> str:
        """What is still held (an incomplete character, as U+FFFD); the stream starts afresh."""
        return self._decoder.flush().decode("utf-8")


def validate(image: bytes | bytearray | memoryview, *, check: str = "full") -> None:
    """Validation by the C engine (check="full", or "structure": no payload CRCs); raises the engine's
    ImageError on failure."""
    status = image_status(image, check=check)
    if status != 0:
        raise error_for(status)


def image_status(image: bytes | bytearray | memoryview, *, check: str = "full") -> int:
    """The C engine's status for an image (0: valid): check="full", or "structure" (no payload CRCs)."""
    return _engine.validate(image) if check == "full" else _engine.validate_structure(image)


def arena_size(image: bytes | bytearray | memoryview, workers: int = 1) -> int:
    """colibri_model_size (workers 1), or colibri_model_size_ex for that many workers."""
    status, size = _engine.model_size(image) if workers == 1 else _engine.model_size_ex(image, workers)
    if status != 0:
        raise error_for(status)
    return size


def version() -> str:
    return _engine.version()
