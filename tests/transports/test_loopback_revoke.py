"""The loopback transport's ``revoke()`` waits for the writes of the links it cuts off, and only for those.

A receiver revokes a sender's writer when its session is lost, then shakes hands again: the same sender process
(the same writer id) opens a new link at once and writes through it. ``revoke()`` counted every landing write of
the writer, the new link's too, so while the new session kept a write landing it did not return, and the blocks
of the lost session, freed only by that revocation, stayed fenced.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import pytest
import torch

from aioembed.testing.conformance import region_of
from aioembed.transports.base import WriteOp
from aioembed.transports.loopback import LoopbackLink, LoopbackTransport

from ..faults.conftest import anyio_backend  # noqa: F401  (every supported loop)

pytestmark = pytest.mark.anyio


def _gated(link: LoopbackLink, gate: anyio.Event, landing: anyio.Event) -> None:
    """Writes through ``link`` land (counted as landing at the owner) and hold there until ``gate`` is set."""
    copy = link._copy

    async def held(ops: Sequence[WriteOp], total: int) -> None:
        landing.set()
        await gate.wait()
        await copy(ops, total)

    link._copy = held  # type: ignore[method-assign]


async def test_revoke_returns_once_the_cut_links_writes_ended_though_a_newer_link_writes() -> None:
    async with await LoopbackTransport.open({}) as writer, await LoopbackTransport.open({}) as owner:
        src = torch.arange(256, dtype=torch.uint8)
        dst = torch.zeros(256, dtype=torch.uint8)
        await writer.register([region_of(src)])
        await owner.register([region_of(dst)])
        ops = [WriteOp(src.data_ptr(), dst.data_ptr(), 128)]
        new_ops = [WriteOp(src.data_ptr() + 128, dst.data_ptr() + 128, 128)]
        old = await writer.connect(owner.descriptor())  # the lost session's link
        old_gate, old_landing = anyio.Event(), anyio.Event()
        new_gate, new_landing = anyio.Event(), anyio.Event()
        _gated(old, old_gate, old_landing)
        revoked = anyio.Event()

        async def revoke() -> None:
            await owner.revoke(writer.writer_id)
            revoked.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(old.write, ops)
            await old_landing.wait()
            tg.start_soon(revoke)  # waits for the old link's write, landing now
            await anyio.sleep(0.05)
            new = await writer.connect(owner.descriptor())  # the next session's link, opened after the revoke
            _gated(new, new_gate, new_landing)
            tg.start_soon(new.write, new_ops)
            await new_landing.wait()
            assert not revoked.is_set()
            old_gate.set()  # the cut link's write ends; the new link's goes on
            try:
                with anyio.fail_after(5):
                    await revoked.wait()
                assert torch.equal(dst[:128], src[:128])
                assert not torch.any(dst[128:])  # the new link's write is still landing
            finally:
                new_gate.set()
        assert torch.equal(dst, src)  # the new link was not cut off
        with pytest.raises(Exception, match="revoked"):
            await old.write(ops)  # the old one was
