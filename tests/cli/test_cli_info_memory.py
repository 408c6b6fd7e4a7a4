"""`colibri info` reads a q4 image without unpacking its int4 values (issue 26): its memory does not
grow with the image's parameters, and what it prints is what it printed when it unpacked them.

`colibri info` runs in a subprocess that samples its own RssAnon (/proc/self/status: private memory,
without the mapped pages of the image, which ru_maxrss counts too). Two q4 images differ only in their
number of 2048 x 2048 layers; info's peak over its RssAnon before the command is its working memory.
What it once did: `image.read(check="structure")` unpacked every int4 value into a byte, a byte per
parameter (about 7 GB on a 7 B q4 image)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from click.testing import CliRunner

from colibri import image
from colibri.cli import main
from colibri.cli.info import describe
from colibri.model.ir import Graph, Linear, Q4Weight
from colibri.quant.quantize import quantize_q4
from helpers.anon_peak import cli_script

WIDTH = 2048

SAMPLED_INFO = cli_script(
    """import colibri.cli.info, colibri.image, colibri.runtime.engine, rich.console, rich.table  # noqa: E401""",
    interval=0.001,
)


def q4_image(path: Path, layers: int) -> Path:
    """`layers` Linear layers of WIDTH x WIDTH int4 weights (group 32, a little E, an f16 bias)."""
    rng = np.random.default_rng(layers)
    graph_layers = []
    for _ in range(layers):
        w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
        q = quantize_q4(w, 0.001, bias=(rng.standard_normal(WIDTH) * 0.01).astype(np.float32))
        graph_layers.append(Linear(q, None if q.bias is not None else np.zeros(WIDTH, np.float32)))
    path.write_bytes(image.write(Graph(graph_layers, WIDTH, WIDTH)))
    return path


def working_memory(path: Path) -> int:
    run = subprocess.run([sys.executable, "-c", SAMPLED_INFO, "info", str(path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    return got["peak"] - got["before"]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("info")
    return q4_image(tmp / "one.clb", 1), q4_image(tmp / "six.clb", 6)


def test_info_memory_does_not_grow_with_the_int4_parameters(images: tuple[Path, Path]) -> None:
    few, many = (working_memory(p) for p in images)
    # 5 more layers are 21 M more int4 values: 21 MB unpacked. The growth allowed is the tables' and
    # scales' (5 x 256 KiB of f16 scales are views into the mapping) and the allocator's slack.
    assert many - few <= 4 * 2**20, (few / 2**20, many / 2**20)


def test_info_prints_what_it_printed_with_the_values_unpacked(images: tuple[Path, Path]) -> None:
    read = image.read

    def unpacking(data, **kwargs):
        return read(data, **{**kwargs, "unpack_int4": True})

    runner = CliRunner()
    for path in images:
        data = path.read_bytes()
        packed = describe(data)
        out = runner.invoke(main, ["info", str(path)])
        out_json = runner.invoke(main, ["info", str(path), "--json"])
        with mock.patch.object(image, "read", unpacking):
            assert describe(data) == packed
            assert runner.invoke(main, ["info", str(path)]).output == out.output
            assert runner.invoke(main, ["info", str(path), "--json"]).output == out_json.output
        assert out.exit_code == 0 and "q4/g32+E" in out.output
        assert json.loads(out_json.output)["parameters"] == packed["parameters"] > WIDTH * WIDTH


def test_read_without_unpacking_validates_alike() -> None:
    """`unpack_int4=False` keeps the int4 values packed and checks them as `read` does."""
    rng = np.random.default_rng(0)
    good = image.write(Graph([Linear(quantize_q4(rng.standard_normal((6, 33)).astype(np.float32)))], 33, 6))
    w = image.read(good, check="structure", unpack_int4=False).layers[0].weight
    full = image.read(good).layers[0].weight
    assert isinstance(w, Q4Weight) and w.q.shape == full.q.shape and w.q.strides == (0, 0) and not w.q.any()
    np.testing.assert_array_equal(image.q4_unpack(w.packed, 33), full.q)
    # an odd row's unused high nibble set: refused alike, values unpacked or not
    payload = full.packed.ctypes.data - np.frombuffer(good, np.uint8).ctypes.data
    data = bytearray(good)
    data[payload + 16] |= 0x10  # row 0's last byte (17 bytes a row)
    image.set_tensor_crcs(data)
    errors = []
    for unpack in (True, False):
        with pytest.raises(Exception) as exc:
            image.read(bytes(data), check="structure", unpack_int4=unpack)
        errors.append((type(exc.value), str(exc.value)))
    assert errors[0] == errors[1] and "high nibble" in errors[0][1]
