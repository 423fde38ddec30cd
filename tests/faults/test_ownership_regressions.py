"""Regressions of the block-ownership review: each of these failed on the code before the fix.

1. A receiver frozen long enough to be declared dead, while a write into its blocks is in flight,
   must not hand those blocks to the next room: the late write lands, the next room is intact.
3. A finished zero-copy handle whose lease nobody took is given back (cancel, or garbage collection).
4. ``aclose()`` from another task (a server's shutdown hook) is bounded and leaves the task that
   entered ``async with`` alone.
(2, FENCE_RELEASE after a failed non-cancel-safe write, is in ``test_fencing.py``.)
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from aioembed import (
    AioembedError,
    EmbeddingReceiver,
    EmbeddingSender,
    PeerDead,
    TransferConfig,
    TransferError,
    TransferStatus,
)
from aioembed.protocol.messages import Abort, Hello, Init, Resume, Status, decode
from aioembed.protocol.ownership import GrantState
from aioembed.session.copy_out import RoundCopier
from aioembed.session.handle import TransferStats
from aioembed.session.lease import Lease, LeaseReturns
from aioembed.session.stream import LeasedChunk
from aioembed.testing import MockTransport, WriteCall, WriteFault
from aioembed.testing.event_loops import AnyioBackend, backend_and_options

from ..session.conftest import LAYOUT, assert_same, make_request, running, wait_pools_free
from .rawpeer import raw_sender

pytestmark = pytest.mark.anyio

HB = TransferConfig(default_tokens=1024, pool_tokens=4096, heartbeat_interval=0.1, heartbeat_misses=3,
                    handshake_timeout=2.0, input_timeout=10.0, round_timeout=10.0, resume_reserve_tokens=0)


async def _until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.01)


async def _in(portal: BlockingPortal, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` on the portal's loop without blocking ours."""
    return await anyio.to_thread.run_sync(portal.call, fn, *args)


# -- 1. late write after "peer dead" ------------------------------------------------------------


async def test_frozen_receiver_declared_dead_never_lets_a_late_write_corrupt_the_next_room(
        anyio_backend: AnyioBackend) -> None:
    late = WriteFault(delay=2.5)  # the first write lands (and returns) 2.5 s after it was posted

    def faults(call: WriteCall) -> WriteFault | None:
        return late if call.index == 0 else None

    # B reserves 24 of the pool's 32 blocks: every block but A's 8. Had A's blocks been freed when
    # its sender declared the receiver dead (the old behaviour), B's reservation would include them.
    src_a, src_b = make_request(1000, 1), make_request(3000, 2)
    errors: dict[str, BaseException] = {}
    async with EmbeddingSender(LAYOUT, HB, transport=MockTransport(faults=faults)) as sender:
        # The receiver runs on its own loop in another thread: freezing it does not freeze the sender.
        # (A portal is only ever driven from worker threads: trio refuses it from a loop's thread.)
        portal_cm = start_blocking_portal(*backend_and_options(anyio_backend))
        portal = await anyio.to_thread.run_sync(portal_cm.__enter__)
        try:
            receiver = await _in(portal, lambda: EmbeddingReceiver(LAYOUT, HB, connect=sender.address,
                                                                   transport=MockTransport()))
            cm = portal.wrap_async_context_manager(receiver)
            await anyio.to_thread.run_sync(cm.__enter__)
            try:
                fut_a = await anyio.to_thread.run_sync(portal.start_task_soon, receiver.receive, "A")

                async def send_a() -> None:
                    try:
                        await sender.send("A", src_a)
                    except TransferError as exc:
                        errors["send A"] = exc

                async def freeze() -> None:
                    time.sleep(1.0)  # noqa: ASYNC251  (the point: a long synchronous call on the loop)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_a)
                    await _until(lambda: sender.writes_in_flight == 1)  # A's write is on its way
                    await anyio.to_thread.run_sync(portal.start_task_soon, freeze)
                    await _until(lambda: sender.peers == [], timeout=3)  # the sender declares it dead
                    exc_a = await anyio.to_thread.run_sync(fut_a.exception, 5)
                    assert isinstance(exc_a, PeerDead), exc_a
                    stats = await _in(portal, lambda: receiver.allocator.stats)
                    assert stats.fenced > 0  # A's blocks: a write may still reach them
                    assert not late.landed.is_set()

                    # A new room is served at once, into other blocks, while A's write is in flight.
                    tg.start_soon(sender.send, "B", src_b)
                    lease = await _in(portal, lambda: receiver.receive_leased("B", expected_tokens=3072))
                    assert not late.landed.is_set()  # B was served while A's write was still in flight
                    assert await anyio.to_thread.run_sync(late.landed.wait, 5), "A's write never landed"
                    assert_same(lease.to_tensors(), src_b)  # untouched by the late write
                    await _in(portal, lease.release)
                assert isinstance(errors.get("send A"), PeerDead), errors
                # A's write is over: the sender says so (DRAINED), the blocks come back.
                with anyio.fail_after(5):
                    while (await _in(portal, lambda: receiver.allocator.stats)).used:
                        await anyio.sleep(0.02)
                assert (await _in(portal, lambda: receiver.allocator.stats)).fenced == 0
            finally:
                await anyio.to_thread.run_sync(cm.__exit__, None, None, None)
        finally:
            await anyio.to_thread.run_sync(portal_cm.__exit__, None, None, None)


# -- 3. leases nobody took -----------------------------------------------------------------------

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, heartbeat_interval=0.2)


async def _leased_room(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str) -> Any:
    handle = receiver.start(room, zero_copy=True)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, room, make_request(900, 3))
        assert await handle.wait() is TransferStatus.SUCCESS
    assert receiver.allocator.stats.used > 0
    return handle


async def test_cancel_on_a_finished_zero_copy_handle_gives_the_lease_back() -> None:
    async with running(CFG) as (sender, [receiver]):
        handle = await _leased_room(sender, receiver, "z")
        handle.cancel()
        await wait_pools_free(sender, receiver, timeout=1.0)
        assert handle.status is TransferStatus.SUCCESS


async def test_a_dropped_handle_gives_its_lease_back_with_a_resource_warning() -> None:
    async with running(CFG) as (sender, [receiver]):
        handle = await _leased_room(sender, receiver, "z")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del handle
            gc.collect()
        assert any(issubclass(w.category, ResourceWarning) and "'z'" in str(w.message) for w in caught)
        await wait_pools_free(sender, receiver, timeout=1.0)


async def test_a_dropped_lease_is_given_back_and_a_released_one_is_not_twice() -> None:
    async with running(CFG) as (sender, [receiver]):
        handle = await _leased_room(sender, receiver, "z")
        lease = await handle.lease()
        del handle
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del lease
            gc.collect()
        assert [w for w in caught if issubclass(w.category, ResourceWarning)]
        await wait_pools_free(sender, receiver, timeout=1.0)
        handle = await _leased_room(sender, receiver, "y")
        lease = await handle.lease()
        lease.release()
        handle.cancel()  # taken and released: nothing more to give back (no double free)
        await wait_pools_free(sender, receiver, timeout=1.0)


def test_a_lease_finalizer_only_queues_its_grants() -> None:
    """A garbage collection runs the finalizer in the middle of whatever code allocated, on the loop's thread
    too (say, inside the allocator's own bookkeeping): giving the blocks back there corrupted the free list
    (a block in it twice, so handed to two rooms; found by a review). The finalizer queues; the loop returns
    the grants at its next safe point."""
    given: list[list[int]] = []
    returns = LeaseReturns(given.append)
    lease = Lease(room="z", views={}, metadata={}, num_tokens=0, rounds=1,
                  stats=TransferStats(bytes=0, rounds=1, seconds=0.0), grants=[7, 8], returns=returns)
    lease.cycle = lease  # type: ignore[attr-defined]  # only a collection frees it
    del lease
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert given == [] and returns.pending == 1
    returns.drain()
    assert given == [[7, 8]] and returns.pending == 0


def test_a_lease_released_by_many_threads_at_once_gives_its_grants_back_once() -> None:
    for _ in range(50):
        given: list[list[int]] = []
        returns = LeaseReturns(given.append)
        lease = Lease(room="t", views={}, metadata={}, num_tokens=0, rounds=1,
                      stats=TransferStats(bytes=0, rounds=1, seconds=0.0), grants=[3], returns=returns)
        start = threading.Barrier(4)

        def release(lease: Lease, start: threading.Barrier) -> None:
            start.wait()
            lease.release()

        threads = [threading.Thread(target=release, args=(lease, start)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        returns.drain()
        assert given == [[3]] and lease.released


async def test_lease_context_manager_and_release_from_another_thread() -> None:
    async with running(CFG) as (sender, [receiver]):
        src = make_request(700, 4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "cm", src)
            async with receiver.lease("cm") as lease:
                assert_same(lease.to_tensors(), src)
        await wait_pools_free(sender, receiver, timeout=1.0)
        handle = await _leased_room(sender, receiver, "t")
        lease = await handle.lease()
        await anyio.to_thread.run_sync(lease.release)  # e.g. released by a worker thread
        # back at the receiver's next heartbeat at the latest
        await wait_pools_free(sender, receiver, timeout=3 * CFG.heartbeat_interval)


# -- 4. aclose from another task ----------------------------------------------------------------


async def test_aclose_from_a_shutdown_hook_is_bounded_and_leaves_the_lifespan_task_alone() -> None:
    outcome: dict[str, Any] = {}
    shutdown_done = anyio.Event()

    async def lifespan(*, task_status: anyio.abc.TaskStatus[tuple[EmbeddingSender, EmbeddingReceiver]]) -> None:
        try:
            async with EmbeddingSender(LAYOUT, CFG) as sender, \
                    EmbeddingReceiver(LAYOUT, CFG, connect=sender.address) as receiver:
                await receiver.wait_connected()
                handle = receiver.start("pending")  # a room in flight at shutdown
                task_status.started((sender, receiver))
                await shutdown_done.wait()  # the app runs until its shutdown hook is done
                outcome["room"] = await handle.wait()
            outcome["exited"] = True
        except BaseException as exc:  # cancelled, or an error out of __aexit__
            outcome["error"] = exc
            raise

    async with anyio.create_task_group() as tg:
        sender, receiver = await tg.start(lifespan)
        await _until(lambda: sender.rooms_in_flight == 1)
        t0 = time.monotonic()
        await receiver.aclose()  # from this task, not the one that entered `async with`
        await sender.aclose()
        assert time.monotonic() - t0 < 4.0
        t1 = time.monotonic()
        await receiver.aclose()  # a second close is a no-op
        await sender.aclose()
        assert time.monotonic() - t1 < 0.1
        shutdown_done.set()
    assert outcome == {"room": TransferStatus.ABORTED, "exited": True}


async def test_aclose_is_bounded_when_the_sender_never_acknowledges() -> None:
    async with raw_sender() as raw:
        receiver = EmbeddingReceiver(LAYOUT, CFG, connect=raw.address)
        async with receiver:
            raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
            receiver.start("r")
            await raw.expect(Init)
            t0 = time.monotonic()
            await receiver.aclose()  # its ABORT is never acknowledged: close anyway, in bounded time
            assert time.monotonic() - t0 < 3.0
            assert isinstance(await raw.expect(Abort), Abort)


async def test_entering_and_closing_at_once_does_not_hang() -> None:
    """Background tasks scheduled by __aenter__ and not started yet when aclose() runs must not run."""
    with anyio.fail_after(5):
        async with EmbeddingSender(LAYOUT, CFG) as sender, EmbeddingReceiver(LAYOUT, CFG, connect=sender.address):
            pass
        async with EmbeddingReceiver(LAYOUT, CFG):
            pass


async def test_entered_by_hand_and_closed_by_aclose_in_the_same_task() -> None:
    """``await x.__aenter__()`` ... ``await x.aclose()`` without ``__aexit__`` (a startup / shutdown pair
    of hooks): nothing of ours stays on the caller's scope stack, so the enclosing scope exits cleanly."""
    with anyio.fail_after(10):
        sender = EmbeddingSender(LAYOUT, CFG)
        await sender.__aenter__()
        receiver = EmbeddingReceiver(LAYOUT, CFG, connect=sender.address)
        await receiver.__aenter__()
        src = make_request(300, 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "m", src)
            assert_same((await receiver.receive("m")).tensors, src)
        await receiver.aclose()
        await sender.aclose()
    assert not receiver._tasks.entered and not sender._tasks.entered  # the background tasks ended


async def test_aclose_inside_a_deadline_within_async_with() -> None:
    with anyio.fail_after(10):
        async with EmbeddingSender(LAYOUT, CFG) as sender, \
                EmbeddingReceiver(LAYOUT, CFG, connect=sender.address) as receiver:
            await receiver.wait_connected()
            with anyio.fail_after(5):  # e.g. a server bounding its shutdown
                await receiver.aclose()
            with anyio.move_on_after(5):
                await sender.aclose()


async def test_a_send_in_flight_when_the_sender_closes_ends_with_a_typed_error() -> None:
    """The send() returns after aclose() started: it gets TransferAborted, and releasing its source
    later starts nothing on the closed sender (the old code raised RuntimeError from a dead task group)."""
    async with EmbeddingSender(LAYOUT, CFG) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address) as receiver:
        await receiver.wait_connected()
        outcome: list[BaseException] = []

        async def send() -> None:
            try:
                await sender.send("late", make_request(500, 2))  # no receiver asks for it: waits for INIT
            except BaseException as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            await _until(lambda: sender.rooms_in_flight == 1)
            await sender.aclose()
        (err,) = outcome
        assert isinstance(err, TransferError) and "sender closing" in str(err), repr(err)
        assert sender.writes_in_flight == 0


async def test_a_final_status_still_in_the_inbox_when_the_room_is_cancelled_frees_its_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's last STATUS reached the room while the room was busy copying the round before, and the
    caller cancelled the room then: the sender counts that rank as served and will never answer the room's
    ABORT, so that STATUS is the proof that the last write ended (found by the abort storm once receive()
    ran in the caller's task)."""
    copying = anyio.Event()

    async def slow_copy(self: RoundCopier, *args: Any, **kwargs: Any) -> None:
        copying.set()
        await anyio.sleep(5)  # the room is busy here (cancelled below)

    monkeypatch.setattr(RoundCopier, "copy", slow_copy)
    async with raw_sender() as raw:
        async with EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
            raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
            handle = receiver.start("r")  # 1024 reserved; the request turns out to be 1500 tokens
            await raw.expect(Init)
            raw.send(Status(room="r", state=TransferStatus.TRANSFERRING, total_tokens=1500, sent_tokens=1024,
                            round=0))
            resume = await raw.expect(Resume)  # announced early; the room copies round 0 meanwhile
            assert isinstance(resume, Resume)
            with anyio.fail_after(5):
                await copying.wait()
            raw.send(Status(room="r", state=TransferStatus.SUCCESS, total_tokens=1500, sent_tokens=1500, round=1))
            with anyio.fail_after(5):
                while not len(receiver._rooms["r"]._inbox):
                    await anyio.sleep(0.005)  # the last STATUS waits in the room's inbox
            handle.cancel("the caller gave up")
            assert await handle.wait() is TransferStatus.ABORTED
            assert isinstance(await raw.expect(Abort), Abort)  # the raw sender never acknowledges it
            assert receiver.allocator.stats.used == 0  # the STATUS proved round 1's write over


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a plain Task.cancel() is asyncio's
async def test_a_final_status_met_by_a_plain_task_cancel_is_not_lost() -> None:
    """The sender's last STATUS reached a room waiting for it, and a plain ``Task.cancel()`` (a server dropping
    the request, ``asyncio.timeout`` around ``receive()``) reached the room's task before it resumed. The room's
    inbox was an anyio memory object stream, which hands an item to the waiting receiver: the cancellation
    raised out of its ``receive()`` with the STATUS gone, so the room's end had no proof that the write was
    over and its blocks stayed fenced until the sender answered the ABORT (this raw sender never does)."""
    import asyncio

    async with raw_sender() as raw:
        async with EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
            raw.welcome(await raw.expect(Hello), CFG.heartbeat_interval)
            task = asyncio.ensure_future(receiver.receive("r"))
            await raw.expect(Init)
            driver = receiver._rooms["r"]
            deliver = driver.deliver

            def deliver_then_cancel(event: Any) -> None:
                deliver(event)
                if isinstance(event, Status) and event.state is TransferStatus.SUCCESS:
                    task.cancel()  # in the same loop step: the room's wait has ended, it has not resumed

            driver.deliver = deliver_then_cancel  # type: ignore[method-assign]
            raw.send(Status(room="r", state=TransferStatus.SUCCESS, total_tokens=500, sent_tokens=500, round=0))
            with pytest.raises(asyncio.CancelledError):
                with anyio.fail_after(5):
                    await task
            assert isinstance(await raw.expect(Abort), Abort)  # the raw sender never acknowledges it
            assert receiver.allocator.stats.used == 0, receiver.keeper.ledger.grants()  # the STATUS proved it


async def test_an_abort_crossing_a_fenced_status_is_not_acknowledged_while_the_write_may_land() -> None:
    """The receiver's ABORT (its receive() cancelled) crosses the sender's STATUS(fence=True) on the wire and
    reaches a sender that already dropped the room. It answered ABORT_ACK at once, and the receiver freed the
    fenced blocks on it while the failed write was still due to land: in the next room's rows (a review
    showed room y's rows overwritten). It is answered with the fence again; FENCE_RELEASE comes later."""
    from aioembed.protocol.messages import decode

    cfg = TransferConfig(default_tokens=1024, pool_tokens=1024, staging_tokens=0, heartbeat_interval=5.0)
    fault = WriteFault(error=RuntimeError("engine timeout; may still write"), fail_after=0.3, land_after=2.0)
    transport = MockTransport(cancel_safe_writes=False, write_lifetime=3.0,
                              faults=lambda call: fault if call.index == 0 else None)
    sender = EmbeddingSender(LAYOUT, cfg, transport=transport)
    on_frames = sender._on_frames

    def slow_aborts(frames: list[bytes]) -> None:  # the ABORT is slow on the wire
        try:
            slow = isinstance(decode(frames[1]), Abort)
        except Exception:
            slow = False
        if not slow:
            on_frames(frames)
            return

        async def later() -> None:
            await anyio.sleep(0.4)
            on_frames(frames)
        sender._spawn(later)

    sender._on_frames = slow_aborts  # type: ignore[method-assign]
    async with sender, EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as rx:
        await rx.wait_connected()

        async def first() -> None:
            with pytest.raises(TransferError):
                await sender.send("x", make_request(1000, 1))

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.move_on_after(0.1):
                await rx.receive("x")  # cancelled: ABORT
        await anyio.sleep(1.0)  # the ABORT reached the sender; the write has not landed yet
        assert not fault.landed.is_set() and sender.writes_in_flight == 1
        assert rx.allocator.stats.fenced == rx.allocator.stats.total  # still fenced: no ABORT_ACK freed them
        src = make_request(1000, 2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "y", src)  # waits for the blocks: FENCE_RELEASE after the landing
            lease = await rx.receive_leased("y")
        assert fault.landed.is_set()
        async with lease:
            assert_same(lease.to_tensors(), src)


async def test_a_bad_frame_naming_a_room_being_written_is_answered_with_the_fence() -> None:
    """A frame the sender cannot decode but that names a room was answered with a REJECT naming it: the
    receiver freed the room's blocks on it while the room's write still ran, and the write then landed in
    the next room's rows (found by a review)."""
    import msgpack

    from aioembed.protocol.messages import PROTOCOL_VERSION

    cfg = TransferConfig(default_tokens=1024, pool_tokens=1024, staging_tokens=0, heartbeat_interval=5.0)
    fault = WriteFault(delay=1.0)
    transport = MockTransport(faults=lambda call: fault if call.index == 0 else None)
    async with EmbeddingSender(LAYOUT, cfg, transport=transport) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as rx:
        await rx.wait_connected()
        y = make_request(1000, 2)

        async def quietly(call: Callable[[], Any]) -> None:
            with contextlib.suppress(TransferError):
                await call()

        async with anyio.create_task_group() as tg:
            tg.start_soon(quietly, lambda: rx.receive("x"))
            tg.start_soon(quietly, lambda: sender.send("x", make_request(1000, 1)))
            with anyio.fail_after(5):
                while sender.writes_in_flight == 0:
                    await anyio.sleep(0.01)
            (peer,) = sender._peers.sessions()
            bad = msgpack.packb({"type": "RESUME", "v": PROTOCOL_VERSION, "room": "x", "round": "bogus"})
            sender._on_frames([peer.identity, bad])
            await anyio.sleep(0.2)
            assert not fault.landed.is_set()
            assert rx.allocator.stats.free == 0  # x's blocks stay held or fenced while its write runs
            tg.start_soon(sender.send, "y", y)
            lease = await rx.receive_leased("y")  # gets x's blocks only once x's write ended
            assert fault.landed.is_set()
            async with lease:
                assert_same(lease.to_tensors(), y)


async def test_a_room_ended_while_its_sender_reads_nothing_fences_its_blocks_and_stays_cancelled() -> None:
    """Ending a room sends ABORT to its sender. With the sender's control socket full (it reads nothing), that
    send used to raise before the room's announced blocks were fenced: they stayed announced to nobody for good,
    and the caller's cancellation came out as a plain ``AioembedError``. Now a frame that cannot be queued ends the
    session (the ABORT is lost, so nothing the sender says of the room later can be trusted to be about this
    attempt): the blocks are fenced as for a sender gone, the cancellation stays one, the next session's DRAINED
    frees the blocks, and the room id works again, with the new attempt's rows."""
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=1.0)
    async with EmbeddingSender(LAYOUT, cfg, transport=MockTransport()) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        conn = receiver._conns[sender.address]
        epoch = conn.epoch
        real = conn.chan.send

        def full(frames: Any) -> None:  # what the channel says of a peer that does not read
            raise AioembedError("control socket: 65536 messages queued and not sent (not reading?); refusing more")

        with anyio.CancelScope() as scope:  # a CancelledError escaping as anything else would fail the test here
            async with anyio.create_task_group() as tg:
                tg.start_soon(receiver.receive, "r")  # nobody sends it yet: it waits for input
                await _until(lambda: bool(receiver.keeper.ledger.grants()))
                conn.chan.send = full
                scope.cancel()
        assert scope.cancelled_caught
        assert not conn.ready  # the session ended with the ABORT it could not send
        assert [(g.room, g.state) for g in receiver.keeper.ledger.grants()] == [("r", GrantState.FENCED)]
        conn.chan.send = real
        await receiver.wait_connected(timeout=5)  # a HELLO refused meanwhile is said again after handshake_timeout
        assert conn.epoch > epoch
        await wait_pools_free(sender, receiver)  # the old session's DRAINED proved the blocks quiet
        src = make_request(900, 4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "r", src)
            assert_same((await receiver.receive("r")).tensors, src)


@pytest.mark.parametrize("mode", ["copy", "stream", "zero-copy stream"])
async def test_a_landed_round_is_given_back_when_the_next_resume_cannot_be_sent(mode: str) -> None:
    """A round whose STATUS came is READABLE, and only the room's step refers to it until it is copied out or
    handed on. The next round is announced first (so the sender writes on while this one is copied): when that
    RESUME could not be queued (the sender reads nothing), the room failed with the landed round held by nobody,
    READABLE for good, the pool short of its blocks (found by a review). Now the room's end consumes it: its
    write is over."""
    cfg = TransferConfig(block_size=16, default_tokens=256, max_round_tokens=256, pool_tokens=4096,
                         resume_reserve_tokens=512, handshake_timeout=1.0)
    async with running(cfg) as (sender, (receiver,)):
        conn = receiver._conns[sender.address]
        real = conn.chan.send
        resumes = 0

        def second_resume_refused(frames: Any) -> None:
            nonlocal resumes
            if isinstance(decode(bytes(frames[0])), Resume):
                resumes += 1
                if resumes == 2:  # what the channel says of a peer that does not read
                    raise AioembedError("control socket: 65536 messages queued and not sent (not reading?); "
                                        "refusing more")
            real(frames)

        conn.chan.send = second_resume_refused

        async def send() -> None:
            with pytest.raises(AioembedError):
                await sender.send("r", make_request(1000, 1))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferError):
                if mode == "copy":
                    await receiver.receive("r")
                else:
                    async with receiver.stream("r", zero_copy=mode != "stream") as chunks:
                        async for chunk in chunks:
                            if isinstance(chunk, LeasedChunk):
                                chunk.release()
        assert resumes >= 2
        assert not receiver.keeper.ledger.grants(state=GrantState.READABLE)
        conn.chan.send = real
        await receiver.wait_connected(timeout=5)
        await wait_pools_free(sender, receiver)  # the fenced ones come back with the new session's DRAINED
