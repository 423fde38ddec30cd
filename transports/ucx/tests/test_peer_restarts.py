"""Peers killed and restarted one after another over UCX: the long-lived side holds no more (the shared suite)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aioembed.testing.restarts import PeerRestartSuite

from .conftest import UCX_OPTIONS


class TestPeerRestarts(PeerRestartSuite):
    transport_name = "ucx"
    transport_options = UCX_OPTIONS

    def transport_books(self, transport: Any) -> Mapping[str, int]:
        from aioembed_ucx._graveyard import GRAVEYARD

        return {"links": len(transport._links), "server endpoints": len(transport._server_eps),
                "serving tasks": len(transport._serving), "graveyard": len(GRAVEYARD)}
