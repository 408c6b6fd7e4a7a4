"""The host client's protocol module: framing round trips, refusals, and agreement with the firmware's header."""
from __future__ import annotations

import re

import pytest

from colibri.target import protocol as P

from helpers.build import ROOT


def _c_defines() -> dict[str, int]:
    text = (ROOT / "firmware" / "runner" / "protocol.h").read_text()
    return {m[1]: int(m[2], 0) for m in re.finditer(r"#define PROTO_(\w+) \(?(-?(?:0x[0-9A-Fa-f]+|\d+))u?\)?", text)}


def test_constants_agree_with_the_firmware() -> None:
    c = _c_defines()
    assert c["VERSION"] == P.VERSION and c["MAX_PAYLOAD"] == P.MAX_PAYLOAD
    assert c["HEADER_SIZE"] == P.HEADER.size and c["CRC_SIZE"] == P.CRC.size
    assert c["RESPONSE"] == P.RESPONSE and c["UNKNOWN_SEQ"] == P.UNKNOWN_SEQ and c["MESSAGE_MAX"] == P.MESSAGE_MAX
    for t in P.Type:
        assert c[t.name] == t, t.name
    for s in P.ProtocolStatus:
        assert c[s.name] == s, s.name
    # Token-model requests (protocol 4): the fixed parts of their payloads.
    assert c["FORWARD_TOKENS_REQUEST_HEADER"] == P.FORWARD_TOKENS_REQUEST.size
    assert c["FORWARD_TOKENS_HEADER"] == P.FORWARD_TOKENS_RESPONSE.size
    assert c["GENERATE_REQUEST_HEADER"] == P.GENERATE_REQUEST.size
    assert c["GENERATE_HEADER"] == P.GENERATE_RESPONSE.size
    assert (c["ROWS_ALL"], c["ROWS_LAST"]) == (P.ROWS_ALL, P.ROWS_LAST)
    # Text on the target (protocol 5).
    assert c["GENERATE_TEXT_REQUEST_HEADER"] == P.GENERATE_TEXT_REQUEST.size
    assert c["GENERATE_TEXT_HEADER"] == P.GENERATE_TEXT_RESPONSE.size
    assert (c["GENERATE_TEXT_PROMPT_TEXT"], c["GENERATE_TEXT_STOP_AT_EOS"]) == (P.GENERATE_TEXT_PROMPT_TEXT,
                                                                               P.GENERATE_TEXT_STOP_AT_EOS)


@pytest.mark.parametrize("payload", [b"", b"\x00", b"\x00" * 300, bytes(range(256)) * 16])
def test_round_trip(payload: bytes) -> None:
    frame = P.encode(P.Packet(P.Type.LOAD_CHUNK, 0x1234, payload))
    assert frame.endswith(b"\x00") and b"\x00" not in frame[:-1]
    back = P.decode(frame[:-1])
    assert (back.type, back.seq, back.payload) == (P.Type.LOAD_CHUNK, 0x1234, payload)


def test_decode_refuses_damage() -> None:
    frame = P.encode(P.Packet(P.Type.HELLO, 1, b"abc"))[:-1]
    damaged = bytearray(frame)
    damaged[5] ^= 0x01
    with pytest.raises(P.FrameError, match="CRC|length|COBS"):
        P.decode(bytes(damaged))
    with pytest.raises(P.FrameError, match="shorter"):
        P.decode(P.cobs.encode(b"\x01\x02\x03"))
    with pytest.raises(P.FrameError, match="COBS"):
        P.decode(b"\x05\x01")
