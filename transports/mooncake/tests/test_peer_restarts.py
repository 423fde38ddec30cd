"""Peers killed and restarted one after another over Mooncake: the long-lived side holds no more (the shared suite)."""

from __future__ import annotations

from aioembed.testing.restarts import PeerRestartSuite


class TestPeerRestarts(PeerRestartSuite):
    transport_name = "mooncake"
    transport_options = {"protocol": "tcp", "hostname": "127.0.0.1"}
