"""The format's constants exist once: the C header is generated from colibri.format."""
from __future__ import annotations

import re

from colibri import format as F

from conftest import CORE


def test_generated_header_is_up_to_date() -> None:
    text = (CORE / "include" / "colibri_format.h").read_text()
    assert text == F.c_header(), "run `colibri gen-header` after changing colibri/format.py"


def test_record_sizes_match_the_documented_layout() -> None:
    doc = (CORE.parents[1] / "docs" / "model-format.md").read_text()
    for name, rec in (("Header", F.HEADER), ("Tensor record", F.TENSOR), ("Layer record", F.LAYER),
                      ("MoE record", F.MOE), ("Expert record", F.EXPERT)):
        m = re.search(rf"## {name} \((\d+) bytes\)", doc)
        assert m and int(m.group(1)) == rec.size, name


def test_status_codes_distinct_and_described() -> None:
    codes = [int(s) for s in F.Status]
    assert len(set(codes)) == len(codes)
    assert set(F.STATUS_TEXT) == set(F.Status)
