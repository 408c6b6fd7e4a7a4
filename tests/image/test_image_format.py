"""The format's constants exist once: the C header is generated from colibri.model.format."""
from __future__ import annotations

import re
import struct

import numpy as np
import pytest
import torch

import colibri
from colibri.model import format as F
from colibri import image
from colibri.image import tokenizer_section
from colibri.model.errors import ImageError
from colibri.frontends.exporter import export

from colibri.quant.quantize import quantize

from helpers.build import CORE

from helpers import lmmodels


def test_generated_header_is_up_to_date() -> None:
    text = (CORE / "include" / "colibri_format.h").read_text()
    assert text == F.c_header(), "run `colibri gen-header` after changing colibri/model/format.py"


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


def _with_version(data: bytes, version: int) -> bytes:
    """The image with another format version (the version is outside the CRC, which stays right)."""
    b = bytearray(data)
    struct.pack_into("<H", b, 4, version)
    return bytes(b)


@pytest.fixture(scope="module")
def tiny_image() -> bytes:
    torch.manual_seed(0)
    return export(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)), None).image


def test_version_policy_in_the_header() -> None:
    """The engine reads exactly versions MIN..MAX, and the writer writes one of them."""
    text = (CORE / "include" / "colibri_format.h").read_text()
    assert f"#define COLIBRI_FORMAT_VERSION_MIN {F.MIN_READ_VERSION}u" in text
    assert f"#define COLIBRI_FORMAT_VERSION_MAX {F.MAX_READ_VERSION}u" in text
    assert F.MIN_READ_VERSION <= F.VERSION <= F.MAX_READ_VERSION
    assert F.Status.UNSUPPORTED_VERSION != F.Status.BAD_VERSION


@pytest.mark.parametrize("version,status", [
    (F.MAX_READ_VERSION + 1, F.Status.UNSUPPORTED_VERSION),  # the next format: a newer engine reads it
    (0x1234, F.Status.UNSUPPORTED_VERSION),
    (0, F.Status.BAD_VERSION),  # never a version
    (0xFFFF, F.Status.BAD_VERSION),  # erased flash
])
def test_newer_or_corrupt_version_c_and_python_agree(tiny_image: bytes, version: int, status: F.Status) -> None:
    data = _with_version(tiny_image, version)
    with pytest.raises(ImageError) as py:
        image.read(data)
    assert py.value.status == status
    with pytest.raises(ImageError) as c:
        colibri.validate(data)  # the C engine through the CPython binding
    assert c.value.status == status
    with pytest.raises(ImageError) as init:
        colibri.Model(data)
    assert init.value.status == status
    if status == F.Status.UNSUPPORTED_VERSION:
        want = f"image format version {version} is newer than this engine reads " \
               f"({F.MIN_READ_VERSION}..{F.MAX_READ_VERSION})"
        assert want in str(py.value)


def test_every_readable_version_is_read(tiny_image: bytes) -> None:
    for version in range(F.MIN_READ_VERSION, F.LM_VERSION):
        # v3 lays out its header and metadata differently (per-tensor CRCs): written, not relabelled
        data = (_with_version(tiny_image, version) if version < F.TENSOR_CRC_VERSION
                else image.write(image.read(tiny_image), version=version))
        assert data[4] == version
        image.read(data)
        colibri.validate(data)
    # v4 holds token models only (docs/lm.md; the reader's checks: tests/lm/test_lm_format.py)
    assert image.write(lmmodels.token_model(0))[4] == F.LM_VERSION
    # v5 is written for int4 weights only (the reader's checks: tests/quant/test_quant_q4.py)
    data = image.write(quantize(image.read(tiny_image), "q4"))
    assert data[4] == F.Q4_VERSION
    image.read(data)
    colibri.validate(data)
    # v6 for a token model with a tokenizer section only (tests/lm/test_lm_tokenizer_section.py)
    g = lmmodels.token_model(0, vocab=256)
    g.tokenizer = tokenizer_section.pack(tokenizer_section.TokenizerSection(
        kind=F.TokenizerKind.BYTE_BPE, tokens=[bytes([b]) for b in range(256)],
        types=np.full(256, F.TokenType.NORMAL, np.uint8), pre_tokenizer=F.PreTokenizer.BYTE_LEVEL,
        byte_ids=np.arange(256, dtype=np.uint32)))
    data = image.write(g)
    assert data[4] == F.TOKENIZER_VERSION
    assert image.read(data).tokenizer == g.tokenizer
    colibri.validate(data)
    # v7 (64-bit sizes) is written past 4 GiB or when asked (tests/image/test_image_wide.py)
    assert F.MAX_READ_VERSION == F.WIDE_VERSION
    data = image.write(image.read(tiny_image), version=F.WIDE_VERSION)
    assert data[4] == F.WIDE_VERSION
    image.read(data)
    colibri.validate(data)
    # v7 with a tokenizer section: a token model past 4 GiB keeps its tokenizer
    data = image.write(g, version=F.WIDE_VERSION)
    assert data[4] == F.WIDE_VERSION
    assert image.read(data).tokenizer == g.tokenizer
    colibri.validate(data)


@pytest.mark.parametrize("compensation", [0.0, 0.05])
def test_a_read_q8_weight_dequantises_as_written(compensation: float) -> None:
    """The reader gives the quantiser's weights back, E or none: row pointers [rows + 1] even without E,
    so dense() (the report, the planner, the hook's views) works on a read image."""
    import numpy as np

    from colibri.model.ir import dense
    from colibri.model.walks import weight_slots

    torch.manual_seed(0)
    result = export(torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4)),
                    dtype="q8", compensation=compensation)
    read = image.read(result.image)
    for (name, owner, attr), (_, wrote, _) in zip(weight_slots(read), weight_slots(result.graph)):
        w = getattr(owner, attr)
        assert w.row_ptr.shape == (w.q.shape[0] + 1,), name
        np.testing.assert_array_equal(dense(w), dense(getattr(wrote, attr)), err_msg=name)
