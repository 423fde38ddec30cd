"""Fault tests run on every event loop aioembed supports (asyncio, uvloop, trio)."""

from __future__ import annotations

from aioembed.testing.event_loops import anyio_backend_fixture

anyio_backend = anyio_backend_fixture()
