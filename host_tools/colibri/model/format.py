"""The model image's numbers: the one place they are defined.

`colibri_format.h` for the C engine is generated from this module
(`colibri gen-header`); `tests/image/test_image_format.py` fails if the two drift apart.
"""
from __future__ import annotations

import enum
import json
import struct

MAGIC = 0x52424C43  # b"CLBR" little-endian
VERSION = 2  # the version this writer produces (2: compact Q8_PARAMS, docs/model-format.md)
# The versions this engine and this reader accept (docs/model-format.md "Compatibility").
# A version outside them is UNSUPPORTED_VERSION; 0 and 0xFFFF (erased flash) are never
# versions and stay BAD_VERSION, as a corrupt field.
MIN_READ_VERSION = 1
MAX_READ_VERSION = 7  # 4: token models (docs/lm.md); 5: int4 weights; 6: the tokenizer section; 7: images past 4 GiB
# Version 3 (issue 11): the header CRC covers only the metadata [CRC_START, meta_size) (header and
# tables); each tensor payload has its own CRC-32 in a table, so a mapped file is validated without
# reading its payloads and each expert is verified on its own (docs/model-format.md "Integrity").
TENSOR_CRC_VERSION = 3
INVALID_VERSIONS = (0, 0xFFFF)
NONE = 0xFFFFFFFF  # absent tensor reference
PAYLOAD_ALIGN = 32
PAGE_SIZE = 4096
MAX_BATCH_LIMIT = 65535
MAX_ROUTES = 65535
MAX_SHARED = 16
MAX_RESIDUAL_DEPTH = 16

# Records: struct formats, little-endian, no padding.
HEADER = struct.Struct("<IHHIIIIIIIIIIIIII16x")
TENSOR = struct.Struct("<IIIIBBHI")
LAYER = struct.Struct("<BBHIIIIfII")  # ..., eps, reserved, reserved
MOE = struct.Struct("<IIIIBBHIIIIIII")  # ..., shared_gate, reserved, reserved
EXPERT = struct.Struct("<BBHIIIIIII")

HEADER_SIZE = HEADER.size
HEADER_CRC_OFFSET = 8
CRC_START = 12  # the CRC covers [CRC_START, image_size) (v1, v2) or [CRC_START, meta_size) (v3)
V3_FIELDS = struct.Struct("<II")  # v3: meta_size, crc_table_offset at header offset 64; bytes 72..80 reserved
V3_FIELDS_OFFSET = 64
# Version 4 (issue 12, docs/lm.md): token models. A v3 image plus an attention table; written only
# when a graph has EMBED/ATTENTION layers, so feature models stay v2/v3 and older engines read them.
LM_VERSION = 4
V4_FIELDS = struct.Struct("<II")  # v4: attention_count, attention_table_offset at header offset 72
V4_FIELDS_OFFSET = 72
# Version 5 (issue 14, docs/model-format.md "Quantised weights: I4 with Q4_PARAMS"): a v4 image that
# may also hold I4 weights with their Q4_PARAMS companions. Written only when a graph holds an I4
# tensor, so every other image stays what older engines read. The header is v4's (a feature model's
# attention table is empty).
Q4_VERSION = 5
# Version 6 (issue 26, docs/lm.md "Tokenizer section"): a version-5 token model whose tensor table may
# hold one TOKENIZER tensor, the tokenizer section: its payload is the vocabulary as bytes, merges or
# scores, token types, special ids and the normaliser and pre-tokenizer kinds, laid out with offset
# tables so a device reads it in place. Written only for a token model exported with a tokenizer, so
# every other image stays what older engines read.
TOKENIZER_VERSION = 6
# Version 7 (issue 26, docs/model-format.md "Version 7: images past 4 GiB"): version 5's (or 6's) records and
# rules with 64-bit sizes and offsets where an image past 4 GiB needs them: a 96-byte header whose
# bytes 80..88 hold image_size as a u64 (the u32 at 12 holds min(image_size, 0xFFFFFFFF)), and
# 32-byte tensor records (offset and nbytes u64). Layer, MoE, expert and attention records name
# tensors by index and keep their layout; the tables and the CRC table lie in the metadata, which
# stays below 4 GiB (meta_size and the table offsets stay u32). The writer uses version 7 only for
# an image that does not fit 32 bits (or when asked), so every other image is what it was.
WIDE_VERSION = 7
WIDE_HEADER_SIZE = 96
WIDE_FIELDS = struct.Struct("<Q")  # v7: image_size at header offset 80; bytes 88..96 reserved, zero
WIDE_FIELDS_OFFSET = 80
TENSOR_WIDE = struct.Struct("<QQIIBBHI")  # offset, nbytes, rows, cols, dtype, ndim, reserved, aux
NARROW_LIMIT = 0xFFFFFFFF  # the largest image_size (and so offset, nbytes) versions 1..5 hold
MAX_TENSOR_ELEMENTS = 0xFFFFFFFF  # rows * cols of an F32, F16, I8 or I32 tensor, every version


def header_size(version: int) -> int:
    """The header's bytes in an image of `version`: 80, 96 from version 7 on."""
    return WIDE_HEADER_SIZE if version >= WIDE_VERSION else HEADER_SIZE


def tensor_record(version: int) -> struct.Struct:
    """The tensor record of an image of `version`: 24 bytes, 32 (u64 offset and nbytes) from version 7 on."""
    return TENSOR_WIDE if version >= WIDE_VERSION else TENSOR


# One self-attention block: d_model, n_heads, n_kv_heads, head_dim; tensor refs q_w, q_b, k_w, k_b,
# v_w, v_b, o_w, o_b, q_norm, k_norm; rope_theta, qk_norm_eps, max_seq_len, kv_dtype, flags
# (AttentionFlag, at 65); reserved from ATTENTION_RESERVED on.
ATTENTION = struct.Struct("<IHHIIIIIIIIIIIffIBB14x")
ATTENTION_FLAGS_OFFSET = 65
ATTENTION_RESERVED = 66


class Flag(enum.IntFlag):
    PAGE_ALIGNED = 1


class DType(enum.IntEnum):
    F32 = 1
    F16 = 2
    I8 = 3  # per-output-channel int8; `aux` names its Q8_PARAMS companion
    I32 = 4
    Q8_PARAMS = 5  # scales + sparse f16 compensation of one I8 tensor
    I4 = 6  # packed signed int4, two per byte, row stride ceil(cols/2); `aux` names its Q4_PARAMS (v5)
    Q4_PARAMS = 7  # group scales, optional bias, sparse f16 compensation of one I4 tensor (v5)
    TOKENIZER = 8  # the tokenizer section (v6): a byte payload, rows = nbytes, cols 1, ndim 1


# Bytes per element; Q8_PARAMS has its own layout (docs/model-format.md).
DTYPE_SIZE = {DType.F32: 4, DType.F16: 2, DType.I8: 1, DType.I32: 4}
Q8_PARAMS_HEADER = 8  # v1: u32 nnz, u32 reserved; v2: u32 nnz, u8 param dtype, u8 flags, u16 reserved


Q4_PARAMS_HEADER = 8  # u32 nnz, u8 group_log2, u8 flags, u16 reserved
Q4_PARAMS_FIELDS = struct.Struct("<IBBH")  # the header: nnz, group_log2, flags, reserved
Q4_GROUP_LOG2_MIN = 3  # groups of 8 .. 256 columns share one f16 scale
Q4_GROUP_LOG2_MAX = 8

# RoPE's admissible range (docs/lm.md "Attention record"): with rope_theta >= 1 every inverse
# frequency theta^(-2j/hd) is at most 1, so with positions below MAX_SEQ_LEN = 2^20 every angle is
# below 2^20, where the engine's double cos/sin (argument reduction by π/2 in three parts) is exact
# to the last bit the reference's np.cos gives. A smaller theta or a longer cache is BAD_ATTENTION.
# (The header carries MAX_SEQ_LEN; the C validator writes the theta bound as 1.0f.)
ROPE_THETA_MIN = 1.0
MAX_SEQ_LEN = 1 << 20

# The tokenizer section (format v6, docs/lm.md "Tokenizer section"): the payload of the one TOKENIZER
# tensor. Its header, little-endian: magic, section version, kind, flags, vocab_count, merge_count,
# bos, eos, pad, unk (NONE when absent), normalizer, pre_tokenizer, reserved u16, then the offsets
# (from the section's start) of its arrays: token offsets (u32 x vocab+1), token bytes (and their
# size), types (u8 x vocab), scores (f32 x vocab), merges (u32 x 3 x merge_count: left, right,
# result), merge order (u32 x merge_count, merges sorted by (left, right)), byte ids (u32 x 256),
# the pre-tokenizer's split pattern (UTF-8) and its size; then (section version 2) the offset of the
# token index (u32 x vocab: the ids sorted by their bytes, then by id), which encoding searches; in a
# version-1 section those 4 bytes are reserved (zero), and such a section decodes but does not encode.
TOKENIZER_MAGIC = 0x4B544C43  # b"CLTK" little-endian
TOKENIZER_SECTION_VERSION = 2  # what the writer writes; 1 and 2 are read
TOKENIZER_SECTION_VERSION_MIN = 1
TOKENIZER_INDEX_VERSION = 2  # the first section version with the token index
TOKENIZER_HEADER = struct.Struct("<IHBBIIIIIIBBHIIIIIIIIIII")
TOKENIZER_ARRAY_ALIGN = 4
TOKENIZER_BYTE_IDS = 256


class TokenizerKind(enum.IntEnum):
    BYTE_BPE = 1  # byte-level BPE (GPT-2, Qwen, OLMoE): ranked merges over a 256-byte alphabet
    SENTENCEPIECE_BPE = 2  # SentencePiece BPE (Llama, Mixtral): pieces with scores, U+2581 as space
    SENTENCEPIECE_UNIGRAM = 3  # SentencePiece unigram: pieces with log-probability scores


class TokenizerFlag(enum.IntFlag):
    ADD_DUMMY_PREFIX = 1  # SentencePiece: a space before the text; decoding drops the first piece's
    BYTE_FALLBACK = 2  # SentencePiece: <0xNN> pieces for bytes outside the vocabulary
    REMOVE_EXTRA_WHITESPACES = 4  # SentencePiece's normaliser option
    ADD_PREFIX_SPACE = 8  # byte-level BPE: the ByteLevel pre-tokenizer's add_prefix_space
    IGNORE_MERGES = 16  # byte-level BPE: a word found whole in the vocabulary is not merged


TOKENIZER_KIND_FLAGS = {
    TokenizerKind.BYTE_BPE: TokenizerFlag.ADD_PREFIX_SPACE | TokenizerFlag.IGNORE_MERGES,
    TokenizerKind.SENTENCEPIECE_BPE: (TokenizerFlag.ADD_DUMMY_PREFIX | TokenizerFlag.BYTE_FALLBACK
                                      | TokenizerFlag.REMOVE_EXTRA_WHITESPACES),
    TokenizerKind.SENTENCEPIECE_UNIGRAM: (TokenizerFlag.ADD_DUMMY_PREFIX | TokenizerFlag.BYTE_FALLBACK
                                          | TokenizerFlag.REMOVE_EXTRA_WHITESPACES),
}


class TokenType(enum.IntEnum):
    """How a token decodes (docs/lm.md "Decoding")."""

    NORMAL = 1  # its bytes
    BYTE = 2  # SentencePiece byte fallback <0xNN>: its one byte
    CONTROL = 3  # BOS, EOS and other special tokens: nothing
    UNKNOWN = 4  # byte-level BPE: its bytes; SentencePiece: the unknown surface U+2047 between spaces
    USER_DEFINED = 5  # an added token that is not special: its bytes
    UNUSED = 6  # an embedding row no tokenizer id names (a padded vocabulary): nothing


class Normalizer(enum.IntEnum):
    NONE = 0
    NFC = 1  # byte-level BPE only (Qwen2)


class PreTokenizer(enum.IntEnum):
    NONE = 0  # SentencePiece (its own whitespace handling)
    BYTE_LEVEL = 1  # ByteLevel(use_regex=True): GPT-2's split, then bytes to symbols
    SPLIT_BYTE_LEVEL = 2  # Split(the section's pattern, isolated), then ByteLevel(use_regex=False)


# The Split patterns the C encoder implements (docs/lm.md "Encoding"), as the tokenizer.json files of
# Qwen2/Qwen3 (MoE included) and of Llama 3 write them; a SPLIT_BYTE_LEVEL section holds one of
# these byte for byte. BYTE_LEVEL's own split is GPT-2's (GPT2_PATTERN, for reference).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLIT_PATTERNS = {"qwen2": QWEN2_PATTERN, "llama3": LLAMA3_PATTERN}

SENTENCEPIECE_UNKNOWN_SURFACE = " \u2047 ".encode()  # what SentencePiece decodes its unknown piece to


class Q4Flag(enum.IntFlag):
    """Q4_PARAMS flags byte."""

    BIAS = 1  # an f16 bias [rows] follows the scales


def q4_row_bytes(cols: int) -> int:
    """Bytes of one packed I4 row: two columns a byte, the last high nibble unused for odd cols."""
    return (cols + 1) // 2


def q4_groups(cols: int, group_log2: int) -> int:
    """Scales per row: G = ceil(cols / 2^group_log2)."""
    return (cols + (1 << group_log2) - 1) >> group_log2


def q4_layout(rows: int, cols: int, nnz: int, group_log2: int, bias: bool = False) -> dict[str, int]:
    """Byte offsets of a Q4_PARAMS payload's fields: scale (f16 [rows·G]), bias (f16 [rows], with
    BIAS), then row_ptr, col, val as in a v2 Q8_PARAMS (only with nnz > 0), and its size."""
    at = {"scale": Q4_PARAMS_HEADER}
    pos = Q4_PARAMS_HEADER + 2 * rows * q4_groups(cols, group_log2)
    if bias:
        at["bias"] = pos
        pos += 2 * rows
    ptr = q8_row_ptr_bytes(2, nnz)
    if ptr:
        at["row_ptr"] = pos = _up(pos, ptr)
        pos += ptr * (rows + 1)
        at["col"] = pos = _up(pos, 2)
        pos += 2 * nnz
        at["val"] = pos = _up(pos, 2)
        pos += 2 * nnz
    at["size"] = pos
    return at


class Q8Flag(enum.IntFlag):
    """Q8_PARAMS (format v2) flags byte."""

    BIAS = 1  # a bias [rows] of the parameter dtype follows the scales


def q8_row_ptr_bytes(version: int, nnz: int) -> int:
    """Bytes per compensation row pointer: none without E; v1 always 4; v2 the narrowest that holds nnz."""
    if nnz == 0:
        return 0
    if version < 2:
        return 4
    return 1 if nnz <= 0xFF else 2 if nnz <= 0xFFFF else 4


def _up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def q8_layout(version: int, rows: int, nnz: int, param_bytes: int = 4, bias: bool = False) -> dict[str, int]:
    """Byte offsets of a Q8_PARAMS payload's fields (docs/model-format.md "Quantised weights"):
    scale, bias (v2 with BIAS), row_ptr, col, val (only with nnz > 0) and its size; each field
    starts at a multiple of its element size, the gaps before row_ptr, col and val are zero bytes."""
    at = {"scale": Q8_PARAMS_HEADER}
    pos = Q8_PARAMS_HEADER + param_bytes * rows
    if bias:
        at["bias"] = pos
        pos += param_bytes * rows
    ptr = q8_row_ptr_bytes(version, nnz)
    if ptr:
        at["row_ptr"] = pos = _up(pos, ptr)
        pos += ptr * (rows + 1)
        at["col"] = pos = _up(pos, 2)
        pos += 2 * nnz
        at["val"] = pos = _up(pos, 4 if version < 2 else 2)  # v1 pads the columns to 4 bytes
        pos += 2 * nnz
    at["size"] = pos
    return at


class LayerFlag(enum.IntFlag):
    INT8_ACT = 1  # LINEAR with an I8 weight: int8 activations, int32 accumulation
    INT8_BLOCKS = 2  # the same with one activation scale per 32 columns (not with INT8_ACT)


class ExpertFlag(enum.IntFlag):
    INT8_ACT = 1  # all of the expert's weights I8: int8 activations
    INT8_BLOCKS = 2  # int8 activations, a scale per 32 columns (not with INT8_ACT)


class AttentionFlag(enum.IntFlag):
    # The bit INT8_BLOCKS has in layer and expert flags. Bit 0 (INT8_ACT there) has no attention form:
    # an attention record with it, like any other unknown bit, is BAD_ATTENTION.
    INT8_BLOCKS = 2  # q, k, v and o (all I8 or I4) with int8 activations, a scale per 32 columns


class Op(enum.IntEnum):
    LINEAR = 1
    ACTIVATION = 2
    LAYERNORM = 3
    RMSNORM = 4
    RESIDUAL_PUSH = 5
    RESIDUAL_ADD = 6
    MOE = 7
    EMBED = 8  # token ids -> rows of a [vocab, d_model] table (layer 0 of a token model only)
    ATTENTION = 9  # causal self-attention with RoPE and a KV cache; t0 = attention record index


class Act(enum.IntEnum):
    RELU = 1
    GELU_ERF = 2
    GELU_TANH = 3
    SILU = 4
    TANH = 5
    SIGMOID = 6


class Routing(enum.IntEnum):
    TOP1 = 1  # Switch Transformer
    TOPK_SOFTMAX = 2  # Mixtral: top-k logits, softmax over those
    SOFTMAX_TOPK = 3  # GShard / Qwen-MoE: softmax over all, top-k, optional renorm
    DENSE = 4  # soft mixture over all experts


class MoEFlag(enum.IntFlag):
    RENORMALIZE = 1


class ExpertKind(enum.IntEnum):
    MLP = 1
    GLU = 2


class Status(enum.IntEnum):
    """Engine status codes (negative = failure), shared with colibri.h."""

    OK = 0
    NULL_ARG = -1
    TRUNCATED = -2
    BAD_MAGIC = -3
    BAD_VERSION = -4
    BAD_HEADER = -5
    BAD_CRC = -6
    TABLE_BOUNDS = -7
    TENSOR_BOUNDS = -8
    BAD_TENSOR = -9
    BAD_REF = -10
    BAD_LAYER = -11
    BAD_MOE = -12
    UNSUPPORTED = -13
    ARENA_TOO_SMALL = -14
    ARENA_ALIGN = -15
    IMAGE_ALIGN = -16
    BAD_BATCH = -17
    BUFFER_SIZE = -18
    BAD_CONTEXT = -19
    BAD_QUANT = -20
    BAD_COMPENSATION = -21
    UNSUPPORTED_VERSION = -22
    BAD_EXEC = -23
    # Issue 11: per-tensor integrity (format v3) and the POSIX file layer (posix/colibri_file.h).
    BAD_PAYLOAD_CRC = -24
    FILE_NOT_FOUND = -25
    FILE_OPEN = -26
    MMAP_FAILED = -27
    MLOCK_FAILED = -28
    FILE_CHANGED = -29
    NO_SUCH_EXPERT = -30
    # Issue 12: token models (docs/lm.md).
    BAD_ATTENTION = -31
    CACHE_FULL = -32
    BAD_TOKEN = -33
    MODEL_KIND = -34
    BAD_SAMPLER = -35
    NAN_LOGITS = -36
    # Issue 26: a version-7 image larger than this engine build can address (a 32-bit target, or a
    # build's COLIBRI_MAX_IMAGE_BYTES).
    IMAGE_TOO_LARGE = -37
    # Issue 26: the tokenizer section (format v6, docs/lm.md "Tokenizer section"). (-37 is the
    # 64-bit images' IMAGE_TOO_LARGE, numbered on another branch.)
    BAD_TOKENIZER = -38
    NO_TOKENIZER = -39
    # Issue 26: text the C encoder refuses (colibri_tokenizer_encode).
    BAD_TEXT = -40
    TEXT_NOT_NORMALIZED = -41


STATUS_TEXT = {
    Status.OK: "ok",
    Status.NULL_ARG: "a required pointer argument is NULL",
    Status.TRUNCATED: "image is truncated: buffer shorter than the header or image_size",
    Status.BAD_MAGIC: "not a Colibri model image (bad magic)",
    Status.BAD_VERSION: "invalid model image version field (0 or 0xFFFF: corrupt or erased)",
    Status.BAD_HEADER: "invalid model image header field",
    Status.BAD_CRC: "model image CRC-32 mismatch (corrupted image)",
    Status.TABLE_BOUNDS: "a table lies outside the image or is misaligned",
    Status.TENSOR_BOUNDS: "a tensor payload lies outside the image or is misaligned",
    Status.BAD_TENSOR: "invalid tensor record (dtype, rank or size)",
    Status.BAD_REF: "a layer refers to a missing or wrongly shaped tensor",
    Status.BAD_LAYER: "invalid layer (unknown op, activation, eps, widths or residual nesting)",
    Status.BAD_MOE: "invalid MoE or expert record",
    Status.UNSUPPORTED: "feature not supported by this engine build",
    Status.ARENA_TOO_SMALL: "arena too small for this model (see colibri_model_size)",
    Status.ARENA_ALIGN: "arena must be 8-byte aligned",
    Status.IMAGE_ALIGN: "model image must be 4-byte aligned",
    Status.BAD_BATCH: "batch must be between 1 and the model's max_batch",
    Status.BUFFER_SIZE: "input or output buffer length does not match batch x features",
    Status.BAD_CONTEXT: "context is not initialised or was freed",
    Status.BAD_QUANT: "invalid int8 or int4 quantisation parameters (companion, parameter dtype, group or flags, NaN or negative scale, padding nibble)",
    Status.BAD_COMPENSATION: "invalid sparse compensation term (row pointers, column indices out of range or unsorted, non-finite values)",
    Status.UNSUPPORTED_VERSION: "unsupported model image format version (not in COLIBRI_FORMAT_VERSION_MIN..MAX)",
    Status.BAD_EXEC: "invalid execution options (colibri_exec: struct_size, unknown fields or more workers than the arena holds)",
    Status.BAD_PAYLOAD_CRC: "a tensor payload's CRC-32 does not match its entry in the CRC table (corrupted weights)",
    Status.FILE_NOT_FOUND: "model file not found",
    Status.FILE_OPEN: "model file could not be opened or read (permission, not a regular file, I/O error)",
    Status.MMAP_FAILED: "mmap of the model file failed",
    Status.MLOCK_FAILED: "mlock refused (see RLIMIT_MEMLOCK)",
    Status.FILE_CHANGED: "the model file changed size under its mapping (truncated or rewritten in place; replace it by rename)",
    Status.NO_SUCH_EXPERT: "no such MoE layer or expert in this model",
    Status.BAD_ATTENTION: "invalid attention record (heads, head_dim, norms, rope_theta, max_seq_len or KV dtype)",
    Status.CACHE_FULL: "the KV cache is full: the sequence would pass max_seq_len (reset it)",
    Status.BAD_TOKEN: "a token id is outside the model's vocabulary",
    Status.MODEL_KIND: "wrong call for this model: colibri_lm_* on a feature model or colibri_forward on a token model",
    Status.BAD_SAMPLER: "invalid sampler settings (struct_size, temperature, top_k or top_p)",
    Status.NAN_LOGITS: "the logits contain NaN (or Inf when sampling): no token can be drawn",
    Status.IMAGE_TOO_LARGE: "the image is larger than this engine build addresses (SIZE_MAX, COLIBRI_MAX_IMAGE_BYTES)",
    Status.BAD_TOKENIZER: "invalid tokenizer section (header, kind, flags, special ids, array bounds, token offsets, types, scores, merges or byte ids)",
    Status.NO_TOKENIZER: "the model image holds no tokenizer section (or this engine was built without the tokenizer)",
    Status.BAD_TEXT: "the text to encode is not well-formed UTF-8",
    Status.TEXT_NOT_NORMALIZED: "an NFC tokenizer and text NFC may change: the device cannot encode it (the host can)",
}

_RECORDS = {"HEADER": HEADER, "TENSOR": TENSOR, "TENSOR_WIDE": TENSOR_WIDE, "LAYER": LAYER, "MOE": MOE,
            "EXPERT": EXPERT,
            "ATTENTION": ATTENTION}


def c_header() -> str:
    """Text of colibri_format.h, the C view of this module."""
    out = [
        "/* Generated from host_tools/colibri/model/format.py by `colibri gen-header`. Do not edit. */",
        "#ifndef COLIBRI_FORMAT_H",
        "#define COLIBRI_FORMAT_H",
        "",
        f"#define COLIBRI_MAGIC 0x{MAGIC:08X}u",
        f"#define COLIBRI_FORMAT_VERSION {VERSION}u",
        f"#define COLIBRI_FORMAT_VERSION_MIN {MIN_READ_VERSION}u",
        f"#define COLIBRI_FORMAT_VERSION_MAX {MAX_READ_VERSION}u",
        f"#define COLIBRI_NONE 0x{NONE:08X}u",
        f"#define COLIBRI_PAYLOAD_ALIGN {PAYLOAD_ALIGN}u",
        f"#define COLIBRI_PAGE_SIZE {PAGE_SIZE}u",
        f"#define COLIBRI_MAX_BATCH_LIMIT {MAX_BATCH_LIMIT}u",
        f"#define COLIBRI_MAX_ROUTES {MAX_ROUTES}u",
        f"#define COLIBRI_MAX_SHARED {MAX_SHARED}u",
        f"#define COLIBRI_MAX_RESIDUAL_DEPTH {MAX_RESIDUAL_DEPTH}u",
        f"#define COLIBRI_HEADER_CRC_OFFSET {HEADER_CRC_OFFSET}u",
        f"#define COLIBRI_CRC_START {CRC_START}u",
        f"#define COLIBRI_TENSOR_CRC_VERSION {TENSOR_CRC_VERSION}u",
        f"#define COLIBRI_LM_VERSION {LM_VERSION}u",
        f"#define COLIBRI_Q8_PARAMS_HEADER {Q8_PARAMS_HEADER}u",
        f"#define COLIBRI_Q8_FLAG_BIAS {int(Q8Flag.BIAS)}u",
        f"#define COLIBRI_Q4_VERSION {Q4_VERSION}u",
        f"#define COLIBRI_Q4_PARAMS_HEADER {Q4_PARAMS_HEADER}u",
        f"#define COLIBRI_Q4_FLAG_BIAS {int(Q4Flag.BIAS)}u",
        f"#define COLIBRI_Q4_GROUP_LOG2_MIN {Q4_GROUP_LOG2_MIN}u",
        f"#define COLIBRI_Q4_GROUP_LOG2_MAX {Q4_GROUP_LOG2_MAX}u",
        f"#define COLIBRI_MAX_SEQ_LEN {MAX_SEQ_LEN}u",
        f"#define COLIBRI_ATTENTION_FLAGS_OFFSET {ATTENTION_FLAGS_OFFSET}u",
        f"#define COLIBRI_ATTENTION_RESERVED {ATTENTION_RESERVED}u",
        f"#define COLIBRI_TOKENIZER_VERSION {TOKENIZER_VERSION}u",
        f"#define COLIBRI_TOKENIZER_MAGIC 0x{TOKENIZER_MAGIC:08X}u",
        f"#define COLIBRI_TOKENIZER_SECTION_VERSION {TOKENIZER_SECTION_VERSION}u",
        f"#define COLIBRI_TOKENIZER_SECTION_VERSION_MIN {TOKENIZER_SECTION_VERSION_MIN}u",
        f"#define COLIBRI_TOKENIZER_INDEX_VERSION {TOKENIZER_INDEX_VERSION}u",
        *(f"#define COLIBRI_SPLIT_PATTERN_{name.upper()} {json.dumps(pattern)}"
          for name, pattern in SPLIT_PATTERNS.items()),
        f"#define COLIBRI_TOKENIZER_HEADER_SIZE {TOKENIZER_HEADER.size}u",
        f"#define COLIBRI_TOKENIZER_BYTE_IDS {TOKENIZER_BYTE_IDS}u",
        f"#define COLIBRI_WIDE_VERSION {WIDE_VERSION}u",
        f"#define COLIBRI_WIDE_HEADER_SIZE {WIDE_HEADER_SIZE}u",
        f"#define COLIBRI_WIDE_FIELDS_OFFSET {WIDE_FIELDS_OFFSET}u",
        f"#define COLIBRI_NARROW_LIMIT 0x{NARROW_LIMIT:08X}u",
        f"#define COLIBRI_MAX_TENSOR_ELEMENTS 0x{MAX_TENSOR_ELEMENTS:08X}u",
        "",
    ]
    for name, rec in _RECORDS.items():
        out.append(f"#define COLIBRI_{name}_SIZE {rec.size}u")
    out.append("")
    for enum_cls, prefix in (
        (Flag, "FLAG"),
        (LayerFlag, "LAYER_FLAG"),
        (ExpertFlag, "EXPERT_FLAG"),
        (AttentionFlag, "ATTENTION_FLAG"),
        (DType, "DTYPE"),
        (Op, "OP"),
        (Act, "ACT"),
        (Routing, "ROUTING"),
        (MoEFlag, "MOE_FLAG"),
        (ExpertKind, "EXPERT"),
        (TokenizerKind, "TOKENIZER"),
        (TokenizerFlag, "TOKENIZER_FLAG"),
        (TokenType, "TOKEN"),
        (Normalizer, "NORMALIZER"),
        (PreTokenizer, "PRE_TOKENIZER"),
    ):
        for member in enum_cls:
            out.append(f"#define COLIBRI_{prefix}_{member.name} {int(member)}u")
        out.append("")
    out.append("typedef enum colibri_status {")
    for st in Status:
        out.append(f"    COLIBRI_{'OK' if st == Status.OK else 'E_' + st.name} = {int(st)}, /* {STATUS_TEXT[st]} */")
    out.append("} colibri_status;")
    out += ["", "/* X(code, message) for every status, for colibri_strerror(). */", "#define COLIBRI_STATUS_LIST(X) \\"]
    for st in Status:
        out.append(f"    X({int(st)}, \"{STATUS_TEXT[st]}\") \\")
    out.append("")
    out += ["", "#endif /* COLIBRI_FORMAT_H */", ""]
    return "\n".join(out)
