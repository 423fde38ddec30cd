"""Block ownership across the receiver's frame routing: a FENCE_RELEASE must not overtake the
STATUS(fence=True) it answers.

The sender sends ``STATUS(FAILED, fence=True)`` for a room, then ``FENCE_RELEASE`` once the write can no longer
land (at once, when the write ends right after the room failed). The receiver hands the STATUS to the room's
inbox (the room acts on it when its task runs) but acted on FENCE_RELEASE in the connection, at once; the
ledger ignores a FENCE_RELEASE for a grant that is still ANNOUNCED ("needs its STATUS first"), and the room then
fenced the grant for good: no proof comes again in a live session, so the blocks stayed out of the pool until
the session happened to end and a DRAINED followed.
"""

from __future__ import annotations

import anyio
import pytest

from aioembed import EmbeddingReceiver, TransferError, TransferStatus
from aioembed.protocol.messages import FenceRelease, Status, encode
from aioembed.testing import MockTransport
from tests.faults.test_ownership_sessions import CFG, LAYOUT, ORPHAN_LIFETIME, ScriptedSender, Violations

pytestmark = pytest.mark.anyio


async def test_a_fence_release_bundled_behind_its_fence_status_frees_the_blocks() -> None:
    box: list[EmbeddingReceiver] = []
    sender_box: list[ScriptedSender] = []
    try:
        async with anyio.create_task_group() as tg:
            sender = ScriptedSender(box, Violations(), tg)
            sender_box.append(sender)
            await sender.start()
            transport = MockTransport(orphan_lifetime=ORPHAN_LIFETIME)
            async with EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=transport) as receiver:
                box.append(receiver)
                await receiver.wait_connected()
                handle = receiver.start("r")
                with anyio.fail_after(5):
                    while "r" not in sender.rooms:
                        await anyio.sleep(0.01)
                assert sender.identity is not None
                # Both frames leave in one ZeroMQ message (a bundle, as a sender's channel sends frames that
                # queued up): the receiver's I/O task handles them one after the other, before the room's task
                # runs. (Queued as behind a peer at its high-water mark: the I/O task bundles them.)
                chan = sender.chan
                chan._send_now = lambda frames: False  # type: ignore[method-assign]
                fence = Status(room="r", state=TransferStatus.FAILED, total_tokens=0, sent_tokens=0, round=0,
                               error="write failed", fence=True)
                chan.send([sender.identity, encode(fence)])
                chan.send([sender.identity, encode(FenceRelease(room="r"))])
                del chan._send_now
                with anyio.fail_after(5):
                    while chan.queued:
                        await anyio.sleep(0.005)
                assert chan.bundles_sent == 1
                with pytest.raises(TransferError):
                    with anyio.fail_after(5):
                        await handle.result()
                assert receiver.fenced_blocks  # the STATUS fenced the room's blocks
                # FENCE_RELEASE proves the write can no longer land: freed after the settle window (0.2 s).
                with anyio.fail_after(3):
                    while receiver.fenced_blocks or receiver.allocator.stats.used:
                        await anyio.sleep(0.02)
                assert len(receiver.keeper.ledger) == 0
            tg.cancel_scope.cancel()
    finally:
        for s in sender_box:
            await s.close()
