"""Three encoder processes into two language-model processes over NIXL (the shared suite)."""

from __future__ import annotations

from aioembed.testing.many_senders import ManySendersSuite

from .conftest import NIXL_TCP_OPTIONS


class TestManySenders(ManySendersSuite):
    transport_name = "nixl"
    transport_options = NIXL_TCP_OPTIONS  # across processes as across hosts
    backends = ("asyncio", "uvloop")
