"""Fixtures for the aioembed-mooncake tests (pytest with anyio's plugin: ``@pytest.mark.anyio``)."""

from __future__ import annotations

from aioembed.testing.event_loops import anyio_backend_fixture

anyio_backend = anyio_backend_fixture()
