"""Fixtures for the aioembed-mooncake tests (pytest with anyio's plugin: ``@pytest.mark.anyio``)."""

from __future__ import annotations

import pytest
from aioembed.testing.event_loops import AnyioBackend, anyio_backends


@pytest.fixture(params=anyio_backends())
def anyio_backend(request: pytest.FixtureRequest) -> AnyioBackend:
    return request.param
