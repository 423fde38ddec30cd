"""Fixtures for the aioembed-mooncake tests (pytest with anyio's plugin: ``@pytest.mark.anyio``)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
