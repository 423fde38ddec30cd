"""Peers killed and restarted one after another over NIXL: the long-lived side holds no more (the shared suite)."""

from __future__ import annotations

from aioembed.testing.restarts import PeerRestartSuite

from .conftest import NIXL_TCP_OPTIONS


class TestPeerRestarts(PeerRestartSuite):
    transport_name = "nixl"
    transport_options = NIXL_TCP_OPTIONS  # across processes as across hosts
