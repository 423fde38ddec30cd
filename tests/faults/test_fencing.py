"""A failed write on a transport that cannot cancel writes may land later: its blocks stay fenced
until the sender is gone, and the sender keeps the source registered for a grace period."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import anyio
import pytest

from aioembed import TransferConfig, TransferFailed, TransportError
from aioembed.transports import registry
from aioembed.transports.base import TransportCapabilities, WriteOp
from aioembed.transports.loopback import LoopbackLink, LoopbackTransport

from ..session.conftest import make_request, running

pytestmark = pytest.mark.anyio


class LateLandingTransport(LoopbackTransport):
    """Loopback whose second write of each link 'times out' (and is not cancel-safe)."""

    name: ClassVar[str] = "late-landing"
    capabilities: ClassVar[TransportCapabilities] = TransportCapabilities(
        cross_process=False, cancel_safe_writes=False)


@pytest.fixture
def late_landing(monkeypatch: pytest.MonkeyPatch) -> None:
    builtin = registry._builtin
    monkeypatch.setattr(registry, "_builtin", lambda: {**builtin(), "late-landing": LateLandingTransport})
    original = LoopbackLink.write
    calls = {"n": 0}

    async def write(self: LoopbackLink, ops: Sequence[WriteOp]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise TransportError("write timed out after 5 s; the destination may still be written")
        await original(self, ops)

    monkeypatch.setattr(LoopbackLink, "write", write)


async def test_failed_uncancellable_write_fences_blocks(late_landing: None) -> None:
    cfg = TransferConfig(transport="late-landing", default_tokens=1024, pool_tokens=4096, round_timeout=0.5)
    async with running(cfg) as (sender, [receiver]):
        failures: list[BaseException] = []

        async def send() -> None:
            try:
                await sender.send("r", make_request(3000, 1))
            except TransferFailed as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferFailed, match="may still be written"):
                await receiver.receive("r")
        assert failures and "failed" in str(failures[0])
        st = receiver.allocator.stats
        assert st.fenced > 0 and st.free < st.total  # not reused while a late write may land
        assert len(sender._transport.regions) > 0  # type: ignore[union-attr]  # source still registered
        # another room still works with the rest of the pool
        src = make_request(500, 2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "next", src)
            got = await receiver.receive("next")
        assert got.num_tokens == 500
        await anyio.sleep(0.7)  # the grace period passes: the sender lets the source go
        assert len(sender._transport.regions) == 0  # type: ignore[union-attr]
