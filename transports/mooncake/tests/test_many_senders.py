"""Three encoder processes into two language-model processes over Mooncake TCP (the shared suite)."""

from __future__ import annotations

from aioembed.testing.many_senders import ManySendersSuite


class TestManySenders(ManySendersSuite):
    transport_name = "mooncake"
    transport_options = {"protocol": "tcp", "hostname": "127.0.0.1"}
    backends = ("asyncio", "uvloop", "trio")
