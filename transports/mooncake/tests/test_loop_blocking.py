"""Opening a Mooncake endpoint never holds the event loop (#12 item 5): the host name lookup and the
engine's start run in worker threads."""

from __future__ import annotations

import time

import pytest
from aioembed.testing.loop import loop_stalls
from aioembed.transports.registry import open_transport

import aioembed_mooncake.transport as mooncake_transport

pytestmark = pytest.mark.anyio


async def test_a_slow_host_name_lookup_does_not_hold_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    lookup = 1.0  # a DNS server that answers slowly

    def slow_default_hostname() -> str:
        time.sleep(lookup)
        return "127.0.0.1"

    monkeypatch.setattr(mooncake_transport, "default_hostname", slow_default_hostname)
    async with loop_stalls() as stalls:
        transport = await open_transport("mooncake", {"protocol": "tcp"})  # no hostname: it is looked up
        await transport.aclose()
    assert stalls.longest < lookup / 3, stalls.longest
