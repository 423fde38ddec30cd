"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Every async test of this folder runs on asyncio and on trio."""
    return str(request.param)
