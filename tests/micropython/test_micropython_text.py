"""colibri.LM's text in the real MicroPython interpreter (docs/lm.md "Encoding", "Decoding"): encode,
decode and generate_text with the image's own tokenizer section, by the C engine inside the module,
equal the host's id for id and byte for byte (the `tokenizers` / `sentencepiece` library's
encoding, colibri.LM.decode and generate_text), for byte-level BPE and SentencePiece BPE and
unigram tokenizers trained here; what the device refuses is a ValueError naming the engine's status.
"""
from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest

import colibri
from colibri import image
from colibri.image import tokenizer_section as TS
from colibri.model import format as F
from colibri.model.format import STATUS_TEXT, Status
from colibri.runtime import tokenizer_build
from helpers import lmmodels
from helpers import tokenizers_trained as trained
from helpers.micropython import BUILTIN, mp_script, run_mp

pytestmark = pytest.mark.micropython

KINDS = {
    "byte_bpe": lambda d: trained.byte_bpe(d),
    "byte_bpe_qwen2_nfc": lambda d: trained.byte_bpe(d, regex_split=F.QWEN2_PATTERN, nfc=True),
    "sp_bpe": lambda d: trained.sentencepiece_model(d),
    "sp_unigram": lambda d: trained.sentencepiece_model(d, model_type="unigram"),
}
PROMPTS = trained.CORPUS + ["I'm sure they'LL see", "  x  \n\n y", "<|endoftext|>colibri bird"]
NEW = 12

SCRIPT = """
import sys
import colibri


def read(path):
    with open(path, "rb") as f:
        return f.read()


def hx(b):
    return "".join("%02x" % c for c in b)


prompts = read(sys.argv[2]).split(b"\\x00")
for line in open(sys.argv[1]):
    name, path = line.split()
    lm = colibri.LM(read(path))
    print("SPECIAL", name, lm.eos, lm.bos)
    for i, raw in enumerate(prompts):
        text = raw.decode()
        try:
            ids = lm.encode(text)
        except ValueError as e:
            print("REFUSED", name, i, e)
            continue
        assert lm.encode(raw) == ids
        print("ENC", name, i, ids)
        print("DEC", name, i, hx(lm.decode(ids).encode()))
        print("GEN", name, i, hx(lm.generate_text(text, NEW_TOKENS).encode()))
    try:
        lm.encode(b"ok\\xff")
    except ValueError as e:
        print("BAD", name, e)
""".replace("NEW_TOKENS", str(NEW))


def host_lm(path: Path) -> colibri.LM:
    return colibri.LM(path, reference_kernels=not BUILTIN)


@pytest.fixture(scope="module")
def text_run(mpy_dir: Path, tmp_path_factory) -> tuple[dict[str, Path], str]:
    tmp = tmp_path_factory.mktemp("mp_text")
    paths, lines = {}, []
    for name, make in KINDS.items():
        make(tmp / name)
        section = tokenizer_build.from_folder(tmp / name)
        g = lmmodels.token_model(5, vocab=section.vocab_size + 2, max_seq_len=128)
        g.tokenizer = TS.pack(section.padded(g.vocab_size))
        paths[name] = tmp / f"{name}.clb"
        paths[name].write_bytes(image.write(g))
        lines.append(f"{name} {paths[name]}")
    (tmp / "manifest.txt").write_text("\n".join(lines) + "\n")
    (tmp / "prompts.bin").write_bytes(b"\x00".join(p.encode() for p in PROMPTS))
    r = run_mp(mp_script(tmp, "text.py", SCRIPT), "manifest.txt", "prompts.bin", mpy_dir=mpy_dir, cwd=tmp,
               timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return paths, r.stdout


def _lines(stdout: str, tag: str, name: str) -> dict[int, str]:
    out = {}
    for ln in stdout.splitlines():
        parts = ln.split(None, 3)
        if parts[0] == tag and parts[1] == name:
            out[int(parts[2])] = parts[3] if len(parts) > 3 else ""
    return out


@pytest.mark.parametrize("name", list(KINDS))
def test_text_equals_the_host(text_run, name: str) -> None:
    paths, stdout = text_run
    host = host_lm(paths[name])
    enc, dec, gen = (_lines(stdout, tag, name) for tag in ("ENC", "DEC", "GEN"))
    refused = _lines(stdout, "REFUSED", name)
    nfc = name.endswith("nfc")
    for i, prompt in enumerate(PROMPTS):
        if i in refused:  # only an NFC tokenizer refuses, and only text NFC may change
            assert nfc and any(unicodedata.combining(c) for c in prompt), (name, prompt)
            assert STATUS_TEXT[Status.TEXT_NOT_NORMALIZED] in refused[i]
            continue
        ids = host.encode(prompt)
        assert enc[i] == str(ids), (name, prompt)
        assert bytes.fromhex(dec[i]).decode() == host.decode(ids), (name, prompt)
        assert bytes.fromhex(gen[i]).decode() == host.generate_text(prompt, NEW), (name, prompt)
    assert len(enc) + len(refused) == len(PROMPTS)
    line = next(ln for ln in stdout.splitlines() if ln.startswith(f"SPECIAL {name} "))
    assert line.split()[2:] == [str(host.eos), str(host.bos)]
    bad = next(ln for ln in stdout.splitlines() if ln.startswith(f"BAD {name} "))
    assert STATUS_TEXT[Status.BAD_TEXT] in bad


def test_no_tokenizer(mpy_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "plain.clb").write_bytes(image.write(lmmodels.token_model(0)))
    code = """
import colibri
lm = colibri.LM(open("plain.clb", "rb").read())
print("EOS", lm.eos, lm.bos)
for call in (lambda: lm.encode("hi"), lambda: lm.decode([1, 2]), lambda: lm.generate_text("hi", 2)):
    try:
        call()
    except ValueError as e:
        print("ERR", e)
"""
    r = run_mp(mp_script(tmp_path, "plain.py", code), mpy_dir=mpy_dir, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "EOS None None"
    errors = [ln for ln in lines if ln.startswith("ERR ")]
    assert len(errors) == 3 and all(STATUS_TEXT[Status.NO_TOKENIZER] in ln for ln in errors), r.stdout
