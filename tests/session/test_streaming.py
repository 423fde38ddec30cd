"""Streaming receive over the loopback transport (the shared suite every transport runs)."""

from __future__ import annotations

from aioembed.testing.streaming import StreamingSuite


class TestStreamingLoopback(StreamingSuite):
    transport_name = "loopback"
