"""The model image: the writer (Graph -> bytes), the reader and validator (bytes -> Graph, or the
engine's status code), and the byte codecs both share (q8/q4 payloads, CRCs).
Layer: imports colibri.model only."""
from .codecs import (
    crc_end, crc_of, q4_pack, q4_params_payload, q4_unpack, q8_params_payload, set_crc, set_tensor_crcs, total_size,
)
from .files import write_atomically
from .reader import Work, check_version, is_token_model, read, status, version_text
from .writer import has_int4, needed_version, wide_needed, write

__all__ = [
    "Work", "check_version", "crc_end", "crc_of", "has_int4", "is_token_model", "needed_version", "q4_pack",
    "q4_params_payload", "q4_unpack", "q8_params_payload", "read", "set_crc", "set_tensor_crcs", "status",
    "total_size", "version_text", "wide_needed", "write", "write_atomically",
]
