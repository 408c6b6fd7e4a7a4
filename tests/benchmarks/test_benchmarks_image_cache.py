"""The benches' image cache (bench/image_cache.py): a cached image counts only for the settings and the
exporter that made it."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import image_cache  # noqa: E402


def test_an_image_is_fresh_only_for_its_settings_and_exporter(tmp_path, monkeypatch):
    image = tmp_path / "m-q4.clb"
    settings = {"dtype": "q4", "max_seq_len": 256}
    assert not image_cache.is_fresh(image, settings)  # nothing there
    image.write_bytes(b"CLB")
    assert not image_cache.is_fresh(image, settings)  # there, but no one says how it was made
    image_cache.mark_fresh(image, settings)
    assert image_cache.is_fresh(image, settings)
    assert not image_cache.is_fresh(image, {**settings, "int8_blocks": ["layers.*"]})
    monkeypatch.setattr(image_cache, "exporter_hash", lambda: "another checkout")
    assert not image_cache.is_fresh(image, settings)


def test_the_exporter_hash_follows_the_quantisers_source(tmp_path, monkeypatch):
    fake = tmp_path / "host_tools" / "colibri" / "quant"
    fake.mkdir(parents=True)
    (fake / "quantize.py").write_text("A = 1\n")
    monkeypatch.setattr(image_cache, "ROOT", tmp_path)
    monkeypatch.setattr(image_cache, "EXPORTER", [fake])
    before = image_cache.exporter_hash()
    (fake / "quantize.py").write_text("A = 2\n")
    assert image_cache.exporter_hash() != before
    assert len(image_cache.exporter_hash()) == 16
