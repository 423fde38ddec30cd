"""Three encoder processes into two language-model processes over Mooncake TCP (the shared suite)."""

from __future__ import annotations

from aioembed.testing.many_senders import ManySendersSuite


class TestManySenders(ManySendersSuite):
    transport_name = "mooncake"
    # One host: no partition can hold a closed socket's bytes, and a killed encoder's blocks come back within the
    # suite's wait (the default, what the kernel retransmits, is 104 s).
    transport_options = {"protocol": "tcp", "hostname": "127.0.0.1", "tcp_orphan_seconds": 1.0}
    backends = ("asyncio", "uvloop", "trio")
