"""Streaming receive over NIXL (the shared suite)."""

from __future__ import annotations

from aioembed.testing.streaming import StreamingSuite

from .conftest import NIXL_OPTIONS


class TestStreaming(StreamingSuite):
    transport_name = "nixl"
    transport_options = NIXL_OPTIONS
    backends = ("asyncio", "uvloop", "trio")
