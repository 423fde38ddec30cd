"""Leases given back on the receiver's edges: a cancel just as a room finished, a release off the loop
just before close, a room in parts cancelled as its parts complete. Each case left pool blocks READABLE
after the room (or the receiver) ended, or handed out a released lease (found by a review)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import anyio
import pytest

from aioembed import Part
from aioembed.config import TransferConfig
from aioembed.errors import TransferAborted, TransferError
from aioembed.protocol.messages import Status, TransferStatus
from aioembed.protocol.ownership import GrantState
from aioembed.samples import deterministic_request, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender

pytestmark = pytest.mark.anyio

BS = 13
LAYOUT = standard_layout(32)


def _config(**kw: Any) -> TransferConfig:
    return TransferConfig(transport="loopback", block_size=BS, default_tokens=8 * BS, max_round_tokens=8 * BS,
                          pool_tokens=96 * BS, resume_reserve_tokens=8 * BS, **kw)



# ``handle.cancel()`` on a zero-copy room that has just finished gives its untaken lease back (as
# documented); a ``handle.lease()`` after it (or already woken by the room's end) then handed out that
# released lease, with no views, instead of saying the room was cancelled.
async def test_lease_after_cancel_of_a_finished_room_raises() -> None:
    cfg = _config()
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected()
        handle = receiver.start("q", zero_copy=True)
        await sender.send("q", deterministic_request(LAYOUT, 50, "q"))
        await handle.wait()
        handle.cancel("a scheduler's deadline, just as the room finished")  # gives the lease back
        with pytest.raises(TransferAborted):
            await handle.lease()
        with anyio.fail_after(10):
            await receiver.allocator.wait_all_free()


# A lease released off the loop's thread just before the receiver closes (CPU pool).
#
# A release from another thread (or a lease's finalizer) only queues its grants; the loop returns them at
# its next release, reservation or heartbeat. The receiver's close ran none of these, so such grants were
# never returned: the ledger kept them READABLE and the allocator short after ``aclose()``. (A CUDA lease
# released with its fence pending while the receiver closes had the same fate through a refused spawn; that
# needs a GPU and is not tested here.)
async def test_lease_released_from_a_thread_before_close_goes_back() -> None:
    cfg = _config(heartbeat_interval=60.0)
    async with EmbeddingSender(LAYOUT, cfg) as sender:
        receiver = EmbeddingReceiver(LAYOUT, cfg, connect=sender.address)
        async with receiver:
            await receiver.wait_connected()
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "a", deterministic_request(LAYOUT, 50, "a"))
                lease = await receiver.receive_leased("a")
            worker = threading.Thread(target=lease.release)  # a consumer thread lets go of it
            worker.start()
            worker.join()
            assert lease.released
        stats = receiver.allocator.stats
        assert not receiver.keeper.ledger.grants(state=GrantState.READABLE)
        assert stats.free == stats.total, stats


# A zero-copy room in parts, ended by ``handle.cancel()`` (the receiver closing, or the caller of
# ``receive_leased(parts=...)`` cancelled) just as its parts' last STATUS frames arrive.
#
# The assembly takes the parts' results when its task group ends, then cancels the parts and waits for them.
# A part whose final STATUS was handed to its driver before the cancel still completes (the cancellation of a
# task whose wait already ended is not delivered at that wait, on asyncio as on trio): it ends with a lease.
# The assembly released the results it had taken before the wait, so such a part's lease was never released:
# its blocks stayed READABLE (after ``aclose()``, for good) until the garbage collector's finalizer gave them
# back with a ``ResourceWarning``.
async def test_parts_completing_as_the_room_is_cancelled_release_their_leases() -> None:
    cfg = _config(input_timeout=30.0, round_timeout=30.0)
    src = deterministic_request(LAYOUT, 160, "parts")
    bounds = [(0, 70), (70, 160)]
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected()
        handle = receiver.start("r", zero_copy=True, parts=[Part(sender.address, a, b) for a, b in bounds])
        conn = receiver._conns[sender.address]
        drivers = [conn.rooms[("r", i)] for i in range(len(bounds))]
        held: dict[int, Any] = {}
        both_held = anyio.Event()

        # The interleaving: each part's final STATUS reaches its driver in the same loop step as the
        # assembly's cancel of that part (the harness holds the frame back until then).
        for i, d in enumerate(drivers):
            deliver = d.deliver

            def hold(event: Any, i: int = i, deliver: Any = deliver) -> None:
                if isinstance(event, Status) and event.state is TransferStatus.SUCCESS:
                    held[i] = event
                    if len(held) == len(drivers):
                        both_held.set()
                    return
                deliver(event)

            cancel = d.handle.cancel

            def cancel_at_arrival(reason: str = "", i: int = i, deliver: Any = deliver, cancel: Any = cancel) -> None:
                if i in held:
                    deliver(held.pop(i))
                cancel(reason)

            d.deliver = hold  # type: ignore[method-assign]
            d.handle.cancel = cancel_at_arrival  # type: ignore[method-assign]

        async def send(i: int, a: int, b: int) -> None:
            with contextlib.suppress(TransferError):
                await sender.send("r", {n: t[a:b] for n, t in src.items()}, part=i)

        async with anyio.create_task_group() as tg:
            for i, (a, b) in enumerate(bounds):
                tg.start_soon(send, i, a, b)
            with anyio.fail_after(10):
                await both_held.wait()
            handle.cancel("receiver closing")  # what aclose() (or a cancelled receive_leased) does
            with anyio.fail_after(10):
                await handle.wait()
        with pytest.raises(TransferAborted):
            await handle.lease()
        assert all(d.handle.done for d in drivers)
        finished = [d.handle._status for d in drivers]
        # The parts' leases (however they ended) are back: no READABLE grant of the room is left.
        left = [(g.room, len(g.blocks)) for g in receiver.keeper.ledger.grants(state=GrantState.READABLE)]
        assert not left, f"parts ended {finished}; their leases still hold {left}"
        with anyio.fail_after(10):
            await receiver.allocator.wait_all_free()
