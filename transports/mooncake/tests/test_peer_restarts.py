"""Peers killed and restarted one after another over Mooncake: the long-lived side holds no more (the shared suite)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aioembed.testing.restarts import PeerRestartSuite


class TestPeerRestarts(PeerRestartSuite):
    transport_name = "mooncake"
    # The engine's TCP lanes end a transfer to a peer that makes no progress at transfer_timeout (the plugin sets
    # their timeout from it): a read that releases a dead peer's connections can wait that long for a reconnect
    # round (seen in CI: the fourth of four reads queued while the lanes reconnected to the refusing port).
    transport_options = {"protocol": "tcp", "hostname": "127.0.0.1", "transfer_timeout": 5}
    # 30 s: the lanes' default, should an engine of the test process have been alive (deciding the variables)
    # when the suite's opened.
    settle_timeout = 30 + 5.0

    def transport_books(self, transport: Any) -> Mapping[str, int]:
        # An idle endpoint sees its leftover transfers end at its next write or link close; the books are read
        # after one look, as that would.
        transport._poller.poll_now()
        return {"links": len(transport._links), "release reads": len(transport._releases),
                "transfers pending": transport._poller.pending}
