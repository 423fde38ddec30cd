"""Peers killed and restarted one after another over UCX: the long-lived side holds no more (the shared suite)."""

from __future__ import annotations

from aioembed.testing.restarts import PeerRestartSuite

from .conftest import UCX_OPTIONS


class TestPeerRestarts(PeerRestartSuite):
    transport_name = "ucx"
    transport_options = UCX_OPTIONS
