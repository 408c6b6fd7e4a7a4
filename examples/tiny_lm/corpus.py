"""The King James Bible as bytes, from Debian's bible-kjv (the text ships in bible-kjv-text).

The text is public domain and installed by scripts/setup.sh, so nothing is downloaded at
run time. Debian stores it compressed for random access; its `bible` program decompresses
it, one verse a line, each line led by a reference such as `Ge1:1 `.

The model sees the verses without their references, one a line, in canonical order. The
held-out text is the last books of the canon (Jude and Revelation): a contiguous span the
model never trained on, so its perplexity is not inflated by near-duplicate neighbours.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

# Debian's abbreviations, as `bible -f` prints them.
HELD_OUT_BOOKS = ("Jude", "Rev")
WHOLE_CANON = "Gen1:1-Rev22:21"
VERSES_IN_KJV = 31102  # the count of the Authorized Version; a shorter dump means a broken install

_REFERENCE = re.compile(r"^(?P<book>\d?[A-Za-z]+)(?P<chapter>\d+):(?P<verse>\d+) (?P<text>.*)$")


@dataclass(frozen=True)
class Corpus:
    train: bytes
    held_out: bytes


def verses() -> list[tuple[str, str]]:
    """(book, text) for every verse, in canonical order."""
    if shutil.which("bible") is None:
        raise RuntimeError(
            "the King James text needs Debian's bible-kjv package (its `bible` program reads the "
            "text from bible-kjv-text): run scripts/setup.sh or `apt-get install bible-kjv`"
        )
    # -f turns pretty-printing off: one verse a line, with its reference. -p pins the data
    # file to the installed one rather than a bible.data in the current directory.
    out = subprocess.run(
        ["bible", "-f", "-p", "/usr/lib", WHOLE_CANON],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, encoding="ascii", check=True,
    ).stdout
    parsed = []
    for n, line in enumerate(out.splitlines(), 1):
        m = _REFERENCE.match(line)
        if m is None:
            raise RuntimeError(f"bible printed line {n} without a verse reference: {line[:80]!r}")
        parsed.append((m["book"], m["text"]))
    if len(parsed) != VERSES_IN_KJV:
        raise RuntimeError(f"bible printed {len(parsed)} verses, the King James Bible has {VERSES_IN_KJV}")
    return parsed


def load() -> Corpus:
    """The training text and the held-out text, each verse on its own line."""
    train, held_out = [], []
    for book, text in verses():
        (held_out if book in HELD_OUT_BOOKS else train).append(text)
    return Corpus(("\n".join(train) + "\n").encode("ascii"), ("\n".join(held_out) + "\n").encode("ascii"))
