"""Peers killed and restarted one after another over Mooncake: the long-lived side holds no more (the shared suite)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aioembed.testing.restarts import PeerRestartSuite


class TestPeerRestarts(PeerRestartSuite):
    transport_name = "mooncake"
    transport_options = {"protocol": "tcp", "hostname": "127.0.0.1"}

    def transport_books(self, transport: Any) -> Mapping[str, int]:
        return {"links": len(transport._links), "release reads": len(transport._releases),
                "transfers pending": transport._poller.pending}
