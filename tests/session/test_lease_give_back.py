"""Leases given back on the receiver's edges: a cancel just as a room finished, a release off the loop
just before close, a room in parts cancelled as its parts complete. Each case left pool blocks READABLE
after the room (or the receiver) ended, or handed out a released lease (found by a review). And leases given
back late: released off the loop while a room waits for their blocks, or stream chunks the caller dropped."""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
from typing import Any

import anyio
import pytest
import torch

from aioembed import Part
from aioembed.config import TransferConfig
from aioembed.errors import AioembedError, TransferAborted, TransferError
from aioembed.protocol.messages import Status, TransferStatus
from aioembed.protocol.ownership import GrantState
from aioembed.samples import deterministic_request, standard_layout
from aioembed.session.assembly import RoomAssembly
from aioembed.session.handle import ReceiveHandle, TransferStats
from aioembed.session.lease import Lease, LeaseReturns
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.testing.event_loops import AnyioBackend, backend_and_options

from .conftest import assert_same, make_request, running

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
# A release from another thread (or a lease's finalizer) only queues its grants and wakes the loop, which
# returns them. One still queued when the receiver closes (the wake-up not yet run) was never returned: the
# ledger kept it READABLE and the allocator short after ``aclose()``. (A CUDA lease
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
            receiver._room_ctx.returns._call_soon = None  # the loop does not get to the wake-up before close
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


# A lease released off the loop's thread (the language model's own thread) while another room waits for its
# blocks. The release only queued the grants, and the waiting room had drained the queue before it began to
# wait: it got them at the connection's next heartbeat (or timed out first, with round_timeout shorter).
async def test_a_room_waiting_for_memory_gets_a_lease_released_from_a_thread_at_once() -> None:
    cfg = TransferConfig(transport="loopback", block_size=16, default_tokens=256, pool_tokens=512,
                         resume_reserve_tokens=256, heartbeat_interval=30.0, round_timeout=60.0, input_timeout=60.0)
    async with running(cfg) as (sender, (receiver,)):
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "a", make_request(200, 1))
            lease = await receiver.receive_leased("a")
        src = make_request(200, 2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "b", src)
            handle = receiver.start("b")
            with anyio.fail_after(10):
                while receiver.allocator.stats.waiters == 0:  # the pool fits one room: b waits for a's blocks
                    await anyio.sleep(0.01)
            worker = threading.Thread(target=lease.release)
            worker.start()
            worker.join()
            with anyio.fail_after(5):  # the next heartbeat is 30 s away
                got = await handle.result()
        assert_same(got.tensors, src)


# Zero-copy stream chunks that the caller uses and drops without release(). The stream kept every chunk it
# handed out, so none was collected and no finalizer gave its blocks back: the next round, which needs the
# blocks of the first (the room is twice the pool), timed out.
async def test_stream_chunks_dropped_without_release_go_back_to_the_pool() -> None:
    cfg = TransferConfig(transport="loopback", block_size=16, default_tokens=256, max_round_tokens=256,
                         pool_tokens=512, resume_reserve_tokens=256, round_timeout=30.0, input_timeout=30.0)
    src = make_request(1024, 7)
    async with running(cfg) as (sender, (receiver,)):
        seen = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender.send, "s", src)
                    async with receiver.stream("s", zero_copy=True, chunk_tokens=0) as chunks:
                        async for chunk in chunks:
                            seen.append(chunk.to_tensors())  # a copy: the chunk is done with
                            del chunk  # ... and dropped, not released
                            gc.collect()
        assert [w for w in caught if issubclass(w.category, ResourceWarning) and "'s'" in str(w.message)]
        assert_same({k: torch.cat([s[k] for s in seen]) for k in src}, src)
        with anyio.fail_after(10):
            await receiver.allocator.wait_all_free()


def _lease(returns: LeaseReturns, grants: list[int]) -> Lease:
    return Lease(room="t", views={}, metadata={}, num_tokens=0, rounds=1,
                 stats=TransferStats(bytes=0, rounds=1, seconds=0.0), grants=grants, returns=returns)


# A burst of releases from another thread wakes the loop once: the wake-up drains everything queued.
async def test_a_burst_of_releases_from_a_thread_wakes_the_loop_once() -> None:
    given: list[list[int]] = []
    returns = LeaseReturns(given.append)
    wakes: list[object] = []
    call_soon = returns._call_soon
    assert call_soon is not None

    def counted(fn: Any) -> None:
        wakes.append(fn)
        call_soon(fn)

    returns._call_soon = counted
    leases = [_lease(returns, [i]) for i in range(50)]
    worker = threading.Thread(target=lambda: [lease.release() for lease in leases])
    worker.start()
    worker.join()  # blocks the loop: nothing drains during the burst
    assert len(wakes) == 1 and returns.pending == 50
    with anyio.fail_after(5):
        while returns.pending:
            await anyio.sleep(0.005)
    assert sorted(g for gs in given for g in gs) == list(range(50))
    _lease(returns, [50]).release()  # on the loop's thread: at once
    worker = threading.Thread(target=_lease(returns, [51]).release)  # a later burst wakes it again
    worker.start()
    worker.join()
    with anyio.fail_after(5):
        while len(given) < 52:
            await anyio.sleep(0.005)


# A release (or a finalizer) after the event loop closed has nothing to wake: it raises nothing, on any thread.
def test_a_release_after_the_loop_closed_raises_nothing(anyio_backend: AnyioBackend) -> None:
    given: list[list[int]] = []

    async def make() -> LeaseReturns:
        return LeaseReturns(given.append)

    name, options = backend_and_options(anyio_backend)
    returns = anyio.run(make, backend=name, backend_options=options)
    errors: list[BaseException] = []

    def release() -> None:
        try:
            _lease(returns, [1]).release()
            returns.release_later([2])  # what a finalizer does
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=release)
    worker.start()
    worker.join()
    assert errors == [] and given == [] and returns.pending == 2


# A zero-copy room in parts whose first part has landed (its lease made) and whose second has not, when the
# receiver closes under ``receive_leased(parts=...)``. The landed part's lease must go back as the room is torn
# down, not when the garbage collector finalizes it (a ``ResourceWarning``, and the pool short until then).
async def test_a_landed_part_of_a_room_aborted_by_close_gives_its_lease_back_at_once() -> None:
    cfg = _config(input_timeout=30.0, round_timeout=30.0)
    src = deterministic_request(LAYOUT, 160, "landed")
    outcome: list[BaseException] = []
    gc.disable()  # a finalizer must not be what gives the lease back
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            async with EmbeddingSender(LAYOUT, cfg) as a, EmbeddingSender(LAYOUT, cfg) as b:
                receiver = EmbeddingReceiver(LAYOUT, cfg)
                async with receiver:
                    parts = [Part(a.address, 0, 70), Part(b.address, 70, 160)]

                    async def receive() -> None:
                        try:
                            await receiver.receive_leased("r", parts=parts)
                        except BaseException as exc:
                            outcome.append(exc)

                    async with anyio.create_task_group() as tg:
                        tg.start_soon(receive)
                        await anyio.wait_all_tasks_blocked()
                        part0 = receiver._conns[a.address].rooms[("r", 0)].handle
                        with anyio.fail_after(10):
                            await a.send("r", {n: t[:70] for n, t in src.items()}, part=0)  # b never sends
                            await part0.wait()
                        assert part0.status is TransferStatus.SUCCESS
                        with anyio.fail_after(10):
                            await receiver.aclose()
                stats = receiver.allocator.stats
                left = [(g.room, len(g.blocks)) for g in receiver.keeper.ledger.grants(state=GrantState.READABLE)]
                assert not left, f"the landed part's lease still holds {left} after close"
                assert stats.free + stats.fenced == stats.total, stats
    finally:
        gc.enable()
    assert len(outcome) == 1 and isinstance(outcome[0], AioembedError), outcome
    assert "'r'" in str(outcome[0]) and "clos" in str(outcome[0]), outcome[0]
    assert not [w for w in caught if issubclass(w.category, ResourceWarning) and "Lease" in str(w.message)]


# The same room's task cancelled from outside (the receiver's close past its grace: a loop stalled longer than
# CLOSE_GRACE) while a part is still going, its last frame in hand: the part ends after the room did, with a
# lease. The room's task gave back only the leases the parts had when it was cancelled: that one went back
# only when the garbage collector finalized it (a ResourceWarning; the pool short until then).
async def test_a_part_ending_after_its_room_was_cancelled_from_outside_gives_its_lease_back() -> None:
    given: list[list[int]] = []
    returns = LeaseReturns(given.append)
    handle = ReceiveHandle("r")
    handle._scope = anyio.CancelScope()
    landing, waiting = ReceiveHandle(("r", 0)), ReceiveHandle(("r", 1))
    parts = [Part("tcp://a", 0, 10), Part("tcp://b", 10, 20)]
    asm = RoomAssembly("r", handle, parts, [landing, waiting], zero_copy=True, output=None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(asm.run)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()  # as the receiver's cancel_all() does
    assert handle.done and landing._cancel_reason and waiting._cancel_reason
    lease = _lease(returns, [7])
    landing._finish(result=lease, status=TransferStatus.SUCCESS)  # its final STATUS was in hand: it completes
    waiting._finish(error=TransferAborted("room ('r', 1): aborted", room=("r", 1)), status=TransferStatus.ABORTED)
    assert lease.released and given == [[7]], given
    with pytest.raises(TransferAborted, match="'r': the receiver closed while its parts were in flight"):
        await handle.lease()
