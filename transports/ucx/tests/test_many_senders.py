"""Three encoder processes into two language-model processes over UCX (the shared suite)."""

from __future__ import annotations

from aioembed.testing.many_senders import ManySendersSuite

from .conftest import UCX_OPTIONS


class TestManySenders(ManySendersSuite):
    transport_name = "ucx"
    transport_options = UCX_OPTIONS
    backends = ("asyncio", "uvloop")  # ucxx runs under asyncio only
