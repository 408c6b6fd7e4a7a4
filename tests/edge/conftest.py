"""Fixtures of the edge-service tests."""

from __future__ import annotations

import pytest

from helpers.edge_service import edge_image


@pytest.fixture(scope="module")
def images() -> tuple[bytes, bytes]:
    return edge_image(11), edge_image(12)
