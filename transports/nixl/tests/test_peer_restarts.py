"""Peers killed and restarted one after another over NIXL: the long-lived side holds no more (the shared suite)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aioembed.testing.restarts import PeerRestartSuite

from .conftest import NIXL_TCP_OPTIONS


class TestPeerRestarts(PeerRestartSuite):
    transport_name = "nixl"
    transport_options = NIXL_TCP_OPTIONS  # across processes as across hosts

    def transport_books(self, transport: Any) -> Mapping[str, int]:
        engine = transport._engine
        return {"links": len(transport._links), "agent peers": len(engine._peers), "agent links": len(engine._links),
                "writes in flight": transport.worker.inflight}
