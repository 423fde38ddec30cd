"""Streaming receive over UCX (the shared suite)."""

from __future__ import annotations

from aioembed.testing.streaming import StreamingSuite

from .conftest import UCX_OPTIONS


class TestStreaming(StreamingSuite):
    transport_name = "ucx"
    transport_options = UCX_OPTIONS
    backends = ("asyncio", "uvloop")  # ucxx runs under asyncio's loops only
