"""Fault tests run on every event loop aioembed supports (asyncio, uvloop, trio)."""

from __future__ import annotations

import pytest

from aioembed.testing.event_loops import AnyioBackend, anyio_backends


@pytest.fixture(params=anyio_backends())
def anyio_backend(request: pytest.FixtureRequest) -> AnyioBackend:
    return request.param
