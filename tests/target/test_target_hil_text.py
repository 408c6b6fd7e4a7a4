"""Text on the device (docs/protocol.md GENERATE_TEXT, protocol 5; docs/lm.md "Encoding" and
"Decoding"): the runner encodes a text prompt with the image's own tokenizer section, generates, and
decodes the new ids with its streaming decoder, in QEMU mps2-an500 (Cortex-M7) unless
`--colibri-port` names a board. The prompt's ids are the host library's, the new ids are what
colibri.LM.generate draws (reference kernels on both sides), and the text is the host's decode of
the same ids; the tokenizer's EOS ends the run; what the device refuses gets its own status."""
from __future__ import annotations

import numpy as np
import pytest

import colibri
from colibri import image
from colibri.image import tokenizer_section as TS
from colibri.model import format as F
from colibri.model.format import Status
from colibri.runtime import tokenizer_build
from colibri.target import protocol as P
from colibri.target.device import Device, DeviceError
from helpers import lmmodels
from helpers import tokenizers_trained as trained

pytestmark = [pytest.mark.qemu, pytest.mark.cross, pytest.mark.usefixtures("no_qemu_left_behind")]

KINDS = {
    "byte_bpe": lambda d: trained.byte_bpe(d),
    "byte_bpe_qwen2_nfc": lambda d: trained.byte_bpe(d, regex_split=F.QWEN2_PATTERN, nfc=True),
    "sp_bpe": lambda d: trained.sentencepiece_model(d),
    "sp_unigram": lambda d: trained.sentencepiece_model(d, model_type="unigram"),
}
PROMPTS = ["Hello, world!", "Grüße aus Köln — 日本語 🎉", "  two  spaces\tand\nlines 12345"]
NEW = 24


def _image(section, *, eos_head: bool = False) -> bytes:
    g = lmmodels.token_model(3, vocab=section.vocab_size + 2, d=32, heads=4, kv_heads=2, hd=8, max_seq_len=96,
                             max_batch=8)
    if eos_head:  # a head that always prefers EOS
        head = g.layers[-1]
        head.weight = np.zeros_like(head.weight)
        head.bias = np.zeros(g.vocab_size, np.float32)
        head.bias[section.eos] = 10.0
    g.tokenizer = TS.pack(section.padded(g.vocab_size))
    return image.write(g)


@pytest.fixture(scope="module")
def sections(tmp_path_factory) -> dict:
    out = {}
    for name, make in KINDS.items():
        folder = tmp_path_factory.mktemp(name)
        make(folder)
        out[name] = tokenizer_build.from_folder(folder)
    return out


def _code(call) -> int:
    with pytest.raises(DeviceError) as info:
        call()
    return info.value.code


@pytest.mark.parametrize("kind", list(KINDS))
def test_text_in_and_out_equal_the_host(dut: Device, sections, kind: str) -> None:
    data = _image(sections[kind])
    dut.load(data)
    dut.kernels(reference=True)
    host = colibri.LM(data, reference_kernels=True)
    for prompt in PROMPTS:
        ids = host.encode(prompt)
        want = host.generate(ids, NEW, stop=None)
        text, got = dut.generate_text(prompt, NEW, stop_at_eos=False)
        assert dut.last_prompt_ids == len(ids), (kind, prompt)
        assert got == want, (kind, prompt)
        assert text == host.decode(want) == host.tokenizer.decode(want), (kind, prompt)  # C and library decode
        # the same run from ids: the prompt's ids go as they are
        assert dut.generate_text(ids, NEW, stop_at_eos=False) == (text, want)
        # sampled, seeded: still the host's draw
        settings = dict(temperature=0.8, top_k=20, top_p=0.9, seed=11)
        text, got = dut.generate_text(prompt, NEW, stop_at_eos=False, **settings)
        want = host.generate(ids, NEW, stop=None, **settings)
        assert got == want and text == host.decode(want), (kind, prompt)
    assert dut.hello().protocol_version == P.VERSION == 5


def test_eos_ends_the_run(dut: Device, sections) -> None:
    section = sections["byte_bpe"]
    data = _image(section, eos_head=True)
    dut.load(data)
    assert dut.generate_text("Hello", 8) == ("", [section.eos])
    text, ids = dut.generate_text("Hello", 8, stop_at_eos=False)
    assert ids == [section.eos] * 8 and text == ""


def test_what_the_device_refuses(dut: Device, sections) -> None:
    """Ill-formed UTF-8, text an NFC tokenizer would change, an image without a tokenizer, an empty
    or too long prompt, unknown flags and short payloads each get their own status; garbage frames
    theirs; and the runner carries on."""
    nfc = _image(sections["byte_bpe_qwen2_nfc"])
    dut.load(nfc)
    header = P.GENERATE_TEXT_REQUEST.pack(4, 0.0, 0, 1.0, 0, P.GENERATE_TEXT_PROMPT_TEXT, 3)
    assert _code(lambda: dut.request(P.Type.GENERATE_TEXT, header + b"a\xffb")) == Status.BAD_TEXT
    assert _code(lambda: dut.generate_text("e\u0301", 4)) == Status.TEXT_NOT_NORMALIZED
    assert _code(lambda: dut.generate_text("", 4)) == Status.BAD_BATCH
    assert _code(lambda: dut.generate_text("x" * 1025, 4)) == P.ProtocolStatus.TOO_LARGE
    assert _code(lambda: dut.generate_text("Hi", 4, temperature=-1.0)) == Status.BAD_SAMPLER
    bad = [
        bytes(31),
        P.GENERATE_TEXT_REQUEST.pack(4, 0.0, 0, 1.0, 0, P.GENERATE_TEXT_PROMPT_TEXT, 5) + b"abc",  # 5 announced
        P.GENERATE_TEXT_REQUEST.pack(4, 0.0, 0, 1.0, 0, 0, 2) + bytes(4),  # 2 ids announced, 1 sent
        P.GENERATE_TEXT_REQUEST.pack(4, 0.0, 0, 1.0, 0, 4, 1) + b"a",  # an unknown flag
    ]
    for payload in bad:
        assert _code(lambda p=payload: dut.request(P.Type.GENERATE_TEXT, p)) == P.ProtocolStatus.BAD_PAYLOAD, payload
    dut.write_raw(b"\x13\x37garbage\xff\x00")
    assert P.status_payload(dut.read_packet())[0] == P.ProtocolStatus.FRAME_DECODE
    host = colibri.LM(nfc)
    assert dut.generate_text("Hello", 3, stop_at_eos=False)[1] == host.generate(host.encode("Hello"), 3, stop=None)
    plain = image.write(lmmodels.token_model(0, vocab=64, d=32, heads=4, kv_heads=2, hd=8, max_seq_len=32,
                                             max_batch=8))
    dut.load(plain)
    assert _code(lambda: dut.generate_text("Hello", 3)) == Status.NO_TOKENIZER
    assert dut.generate([1, 2], 2) == colibri.LM(plain).generate([1, 2], 2)  # GENERATE as before
