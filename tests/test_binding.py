"""colibri.Model: the C engine from CPython, its errors and its buffer handling."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import colibri
from colibri import reference
from colibri import nn as cnn
from colibri.frontends.exporter import export
from colibri.model.format import Status


@pytest.fixture(scope="module")
def exported() -> bytes:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), cnn.MoE(10, 3, 12, top_k=2), torch.nn.Linear(10, 2))
    return export(model, None, max_batch=4).image


def test_sources_and_info(exported: bytes, tmp_path) -> None:
    path = tmp_path / "m.clb"
    path.write_bytes(exported)
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    want = reference.run(colibri.image.read(exported), x)
    for source in (path, str(path), exported, bytearray(exported), memoryview(exported)):
        m = colibri.Model(source)
        np.testing.assert_allclose(m.forward(x), want, rtol=1e-5, atol=1e-6)
    assert (m.input_size, m.output_size, m.max_batch, m.num_experts) == (6, 2, 4, 3)
    assert m.arena_size == colibri.arena_size(exported)
    assert m.image_size == len(exported)
    assert "experts=3" in repr(m)


def test_unaligned_buffer_is_copied_not_refused(exported: bytes) -> None:
    shifted = bytearray(1) + bytearray(exported)
    m = colibri.Model(memoryview(shifted)[1:])
    x = np.ones((1, 6), np.float32)
    np.testing.assert_allclose(m.forward(x), reference.run(colibri.image.read(exported), x), rtol=1e-5, atol=1e-6)


def test_batches_beyond_max_batch_run_in_chunks(exported: bytes) -> None:
    m = colibri.Model(exported)
    x = np.random.default_rng(1).standard_normal((11, 6)).astype(np.float32)
    np.testing.assert_allclose(m.forward(x), reference.run(colibri.image.read(exported), x), rtol=1e-5, atol=1e-6)
    assert m.forward(x[0]).shape == (2,)


@pytest.mark.parametrize(
    "corrupt, status, cls",
    [
        (lambda b: b[:50], Status.TRUNCATED, colibri.ImageError),
        (lambda b: b"NOPE" + b[4:], Status.BAD_MAGIC, colibri.ImageError),
        (lambda b: b[:300] + bytes([b[300] ^ 4]) + b[301:], Status.BAD_CRC, colibri.ImageError),
    ],
)
def test_bad_images_raise_with_status(exported: bytes, corrupt, status: Status, cls) -> None:
    bad = corrupt(exported)
    with pytest.raises(cls) as info:
        colibri.Model(bad)
    assert info.value.status == status
    assert isinstance(info.value, colibri.ColibriError)
    with pytest.raises(cls):
        colibri.validate(bad)
    with pytest.raises(cls) as info_ref:
        reference.run(colibri.image.read(bad), np.zeros((1, 6), np.float32))
    assert info_ref.value.status == status


def test_wrong_input_shape_and_dtype(exported: bytes) -> None:
    m = colibri.Model(exported)
    with pytest.raises(ValueError, match=r"input must be \[batch, 6\]"):
        m.forward(np.zeros((2, 5), np.float32))
    # float64 input is converted, not refused
    np.testing.assert_allclose(m.forward(np.zeros((2, 6))), m.forward(np.zeros((2, 6), np.float32)))


def test_engine_checks_buffer_sizes_itself(exported: bytes) -> None:
    """The binding passes lengths through; the engine refuses mismatches with its own status."""
    m = colibri.Model(exported)
    ctx = m._ctx
    out = np.empty((2, 2), np.float32)
    with pytest.raises(colibri.runtime._engine.EngineError) as info:
        ctx.forward(np.zeros((2, 5), np.float32), out, 2)
    assert info.value.args[0] == Status.BUFFER_SIZE
    with pytest.raises(colibri.runtime._engine.EngineError) as info:
        ctx.forward(np.zeros((5, 6), np.float32), np.empty((5, 2), np.float32), 5)
    assert info.value.args[0] == Status.BAD_BATCH
    with pytest.raises(TypeError, match="float32"):
        ctx.forward(np.zeros((2, 6), np.float64), out, 2)
