"""Streaming receive over Mooncake TCP (the shared suite)."""

from __future__ import annotations

from aioembed.testing.streaming import StreamingSuite


class TestStreaming(StreamingSuite):
    transport_name = "mooncake"
    transport_options = {"protocol": "tcp", "hostname": "127.0.0.1"}
    backends = ("asyncio", "uvloop", "trio")
