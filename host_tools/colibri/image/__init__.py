"""The model image: the writer (Graph -> bytes), the reader and validator (bytes -> Graph, or the
engine's status code), and the q8/q4 payload codecs. Layer: imports colibri.model only."""
from .reader import (
    NONE, Work, check_version, crc_end, crc_of, has_int4, is_token_model, needed_version, q4_pack, q4_params_payload,
    q4_unpack, q8_params_payload, read, set_crc, set_tensor_crcs, status, version_text, write,
)

__all__ = [
    "NONE", "Work", "check_version", "crc_end", "crc_of", "has_int4", "is_token_model", "needed_version", "q4_pack",
    "q4_params_payload", "q4_unpack", "q8_params_payload", "read", "set_crc", "set_tensor_crcs", "status",
    "version_text", "write",
]
