"""Liveness and restarts: a silent peer is declared dead and its rooms end with the reason, but its
blocks stay fenced (silence proves nothing about the data plane) until the sender confirms, in a
later session, that its writes ended (DRAINED); a restarted sender is used at once."""

from __future__ import annotations

import time

import anyio
import anyio.abc
import pytest

from aioembed import (
    EmbeddingReceiver,
    EmbeddingSender,
    PeerDead,
    TransferConfig,
    TransferFailed,
    TransferStatus,
    TransportError,
)
from aioembed.protocol.messages import Abort, AbortAck, Drained, Hello, Init, Ping, Progress, Reject, Status, Welcome
from aioembed.testing import MockTransport, WriteCall, WriteFault

from ..session.conftest import LAYOUT, assert_same, make_request
from .rawpeer import RawReceiver, raw_receiver, raw_sender

pytestmark = pytest.mark.anyio

HB = TransferConfig(default_tokens=1024, pool_tokens=4096, heartbeat_interval=0.2, heartbeat_misses=3,
                    input_timeout=20.0, round_timeout=20.0, handshake_timeout=2.0)
DEAD_WITHIN = HB.heartbeat_interval * (HB.heartbeat_misses + 2) + 1.0


def _free(receiver: EmbeddingReceiver) -> bool:
    st = receiver.allocator.stats
    return st.free == st.total and st.fenced == 0


async def test_silent_receiver_is_declared_dead_and_send_fails() -> None:
    async with EmbeddingSender(LAYOUT, HB) as sender, raw_receiver(sender.address, LAYOUT, HB) as raw:
        raw.send(raw.hello(LAYOUT, HB))
        await raw.expect(Welcome)
        raw.send(Init(room="r", blocks=(0, 1), allocated_tokens=200, expected_ranks=1))
        t0 = time.monotonic()
        with pytest.raises(PeerDead, match="silent"):
            await sender.send("r", make_request(5000, 1))  # first round written, then nobody resumes
        assert time.monotonic() - t0 < DEAD_WITHIN
        assert sender.rooms_in_flight == 0 and sender.peers == []


HOLD = HB.heartbeat_interval * 2.5
"""How long :func:`_hold_the_loop` holds it each time: every heartbeat wake-up comes ~1.5 intervals late."""


async def _hold_the_loop() -> None:
    """A handler that holds the event loop again and again (a server under sustained CPU-bound load)."""
    while True:
        time.sleep(HOLD)  # noqa: ASYNC251 - the point: a handler that holds the loop
        await anyio.lowlevel.checkpoint()


async def test_a_silent_receiver_is_declared_dead_though_the_senders_loop_is_late_on_every_wake_up() -> None:
    """The sender's side of the same: its liveness loop forgave a dead receiver at every late wake-up."""
    async with EmbeddingSender(LAYOUT, HB) as sender, raw_receiver(sender.address, LAYOUT, HB) as raw:
        raw.send(raw.hello(LAYOUT, HB))
        await raw.expect(Welcome)
        raw.send(Init(room="r", blocks=(0, 1), allocated_tokens=200, expected_ranks=1))
        async with anyio.create_task_group() as tg:
            tg.start_soon(_hold_the_loop)
            # (Well before the room's input timeout; each step of send() waits out a pass of the busy loop.)
            with anyio.fail_after(HB.input_timeout / 2), pytest.raises(PeerDead, match="silent"):
                await sender.send("r", make_request(5000, 1))  # first round written, then nobody resumes
            tg.cancel_scope.cancel()
        assert sender.rooms_in_flight == 0 and sender.peers == []


def _fenced(receiver: EmbeddingReceiver) -> bool:
    st = receiver.allocator.stats
    return st.fenced > 0 and st.free < st.total


async def test_silent_sender_fails_the_room_but_its_blocks_stay_fenced_until_it_confirms() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        hello = await raw.expect(Hello)
        raw.welcome(hello, HB.heartbeat_interval)
        handle = receiver.start("r")
        assert isinstance(await raw.expect(Init), Init)
        assert receiver.allocator.stats.used > 0
        raw.pong = False  # the sender hangs: a write of it may still be on its way
        t0 = time.monotonic()
        with pytest.raises(PeerDead, match="silent"):
            await handle.result()
        assert time.monotonic() - t0 < DEAD_WITHIN
        assert _fenced(receiver) and receiver.fenced_blocks == {"peer_silent": receiver.allocator.stats.fenced}
        await anyio.sleep(1.0)
        assert _fenced(receiver)  # silence never frees: a frozen sender writes on when it thaws
        # The sender thaws: the receiver's new session reaches it, it confirms the old one is drained.
        raw.pong = True
        hello2 = await raw.expect(Hello, timeout=5)
        assert isinstance(hello2, Hello) and hello2.epoch == 2 and hello2.receiver_id == hello.receiver_id
        raw.welcome(hello2, HB.heartbeat_interval)
        raw.send(Drained(below_epoch=1))  # says nothing about session 1: nothing freed
        await anyio.sleep(0.5)
        assert _fenced(receiver)
        raw.send(Drained(below_epoch=2))
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_a_silent_sender_is_declared_dead_though_the_receivers_loop_is_late_on_every_wake_up() -> None:
    """A server under sustained overload (a CPU-bound handler holding its loop for longer than the heartbeat
    interval, again and again) still finds a dead sender: each late wake-up forgave it afresh, so it never was
    (the room then ended only by its input timeout, as a timeout, with the session kept for good)."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), HB.heartbeat_interval)
        handle = receiver.start("r")
        assert isinstance(await raw.expect(Init), Init)
        raw.pong = False  # the sender hangs
        async with anyio.create_task_group() as tg:
            tg.start_soon(_hold_the_loop)
            t0 = time.monotonic()
            with anyio.fail_after(HB.input_timeout / 2), pytest.raises(PeerDead, match="silent"):
                await handle.result()
            tg.cancel_scope.cancel()
        assert time.monotonic() - t0 < DEAD_WITHIN + 6 * HOLD
        assert _fenced(receiver)  # silence still frees nothing


async def test_protocol_violation_by_sender_aborts_and_frees_after_ack() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), HB.heartbeat_interval)
        handle = receiver.start("r")
        init = await raw.expect(Init)
        assert isinstance(init, Init)
        # claims more tokens than were reserved
        raw.send(Status(room="r", state="TRANSFERRING", total_tokens=9000, sent_tokens=init.allocated_tokens + 1,
                        round=0))
        abort = await raw.expect(Abort)
        assert isinstance(abort, Abort) and abort.room == "r"
        assert receiver.allocator.stats.fenced > 0  # visible while the sender may still write
        raw.send(AbortAck(room="r"))
        with pytest.raises(TransferFailed, match="protocol violation"):
            await handle.result()
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_unacknowledged_abort_keeps_blocks_fenced_until_a_late_ack() -> None:
    cfg = HB.replace(round_timeout=0.3)
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), cfg.heartbeat_interval)
        handle = receiver.start("r")
        await raw.expect(Init)
        handle.cancel("give up")
        await raw.expect(Abort)
        assert await handle.wait() is TransferStatus.ABORTED  # the room ends at once...
        await anyio.sleep(0.5)
        assert _fenced(receiver)  # ...but its blocks are never handed to another room while unsafe
        assert receiver.fenced_blocks == {"abort_unacked": receiver.allocator.stats.fenced}
        raw.send(AbortAck(room="r"))  # the sender's writes into them ended
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_unacknowledged_abort_stays_fenced_through_silence_until_drained() -> None:
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, HB, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), HB.heartbeat_interval)
        handle = receiver.start("r")
        await raw.expect(Init)
        handle.cancel("give up")
        await raw.expect(Abort)
        raw.pong = False
        await anyio.sleep(DEAD_WITHIN)  # the sender is declared dead meanwhile
        assert _fenced(receiver)
        raw.pong = True
        hello = await raw.expect(Hello, timeout=5)
        raw.welcome(hello, HB.heartbeat_interval)
        raw.send(Drained(below_epoch=hello.epoch))  # type: ignore[union-attr]
        with anyio.fail_after(2):
            while not _free(receiver):
                await anyio.sleep(0.01)


async def test_restarted_sender_serves_new_rooms_at_once() -> None:
    stop = anyio.Event()

    async def serve(bind: str, *, task_status: anyio.abc.TaskStatus[EmbeddingSender]) -> None:
        async with EmbeddingSender(LAYOUT, HB, bind=bind) as s:
            task_status.started(s)
            await stop.wait()

    async with anyio.create_task_group() as tg:
        first = await tg.start(serve, "tcp://127.0.0.1:0")
        address = first.address
        async with EmbeddingReceiver(LAYOUT, HB, connect=address) as receiver:
            src = make_request(3000, 1)
            async with anyio.create_task_group() as inner:
                inner.start_soon(first.send, "before", src)
                got = await receiver.receive("before")
            assert_same(got.tensors, src)
            stop.set()  # the first sender goes away
            with anyio.fail_after(5):
                while not first._closed.is_set():
                    await anyio.sleep(0.01)
            stop = anyio.Event()
            second = await tg.start(serve, address)  # restarted on the same address
            t0 = time.monotonic()
            src2 = make_request(2500, 2)
            async with anyio.create_task_group() as inner:
                inner.start_soon(second.send, "after", src2)
                got2 = await receiver.receive("after")
            assert_same(got2.tensors, src2)
            assert time.monotonic() - t0 < 3.0  # no stale-connection timeout
            assert _free(receiver)
            stop.set()


async def test_a_stream_that_handed_out_rows_fails_when_its_session_drops_instead_of_starting_over() -> None:
    """A room whose rows came by PROGRESS (a stream handed them out) and whose sender then dropped the session
    was treated as having received nothing and opened again from token 0: the stream would see chunk 0 a
    second time (found by a review). It fails now, naming the rows it delivered."""
    cfg = HB.replace(stream_chunk_tokens=256)
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, cfg, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), cfg.heartbeat_interval)
        async with receiver.stream("r") as stream:
            init = await raw.expect(Init)
            assert isinstance(init, Init) and init.progress_tokens == 256
            raw.send(Progress(room="r", round=0, sent_tokens=256, total_tokens=900, metadata={}))
            chunk = await stream.__anext__()
            assert (chunk.start, chunk.end) == (0, 256)
            raw.send(Reject(reason="unknown peer: send HELLO first", room="r", code="unknown_peer"))
            with anyio.fail_after(5), pytest.raises(PeerDead) as err:
                await stream.__anext__()
            assert err.value.delivered == (0, 256)


async def _declared_dead(sender: EmbeddingSender, raw: RawReceiver, room: str, receiver_id: str) -> None:
    """``raw`` shakes hands as ``receiver_id``, asks for ``room`` and goes silent until the sender drops its session."""
    raw.send(raw.hello(LAYOUT, HB, receiver_id=receiver_id))
    await raw.expect(Welcome)
    raw.send(Init(room=room, blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=1))
    with anyio.fail_after(DEAD_WITHIN):
        while sender.rooms_in_flight == 0:
            await anyio.sleep(0.01)
        while any(f"({receiver_id[:8]}," in p for p in sender.peers):  # silent: its session ends, and the room
            await anyio.sleep(0.01)
    assert sender.rooms_in_flight == 0


async def test_a_send_after_its_receiver_was_declared_dead_fails_at_once_naming_it() -> None:
    """A receiver asked for a room, then went silent before ``send()``: the room ended with its session and left
    no tombstone, so ``send()`` waited ``input_timeout`` (20 s here) for an INIT that no one would send, holding the
    caller's tensors, and ended in a ``TransferTimeout`` of phase 'init' that did not name the lost receiver. It
    fails at once now with ``PeerDead`` naming the room and the receiver, once the receiver has had the time a
    slow one takes to come back (``heartbeat_interval x heartbeat_misses`` after the drop); and the receiver, should
    it come back later and ask for the room again, is told at once that the room is over (this ``send()`` failed)
    instead of waiting for a ``send()`` that will not come."""
    async with EmbeddingSender(LAYOUT, HB) as sender, raw_receiver(sender.address, LAYOUT, HB) as raw:
        await _declared_dead(sender, raw, "r", "lost-receiver")
        await anyio.sleep(HB.heartbeat_interval * HB.heartbeat_misses)  # it stays away
        t0 = time.monotonic()
        with anyio.fail_after(HB.input_timeout / 4), \
                pytest.raises(PeerDead, match=r"room 'r'.*lost-rec.*silent") as err:
            await sender.send("r", make_request(300, 1))
        assert err.value.room == "r" and time.monotonic() - t0 < 1.0
        assert sender.rooms_in_flight == 0 and sender.sources_held == 0
        # It thawed: its new session asks for the room again (a receiver opening it again after its session was
        # dropped), and learns at once that it is over.
        raw.send(raw.hello(LAYOUT, HB, receiver_id="lost-receiver", epoch=2))
        await raw.expect(Welcome)
        raw.send(Init(room="r", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=1))
        told = await raw.expect(Status, timeout=1.0)
        assert isinstance(told, Status) and told.room == "r" and told.state is TransferStatus.ABORTED
        assert "silent" in (told.error or "") and not told.fence
        assert sender.rooms_in_flight == 0


async def _keep_alive(raw: RawReceiver, first: int = 1) -> None:
    for nonce in range(first, first + 10_000):
        raw.send(Ping(nonce=nonce))
        await anyio.sleep(HB.heartbeat_interval / 2)


async def test_a_send_right_after_the_drop_waits_and_a_receiver_the_room_is_handed_to_serves_it() -> None:
    """Just after a receiver's session was dropped, a router hands the room to another receiver, and the encoder's
    ``send()`` comes first, its INIT 50 ms later (a review's case): the ``send()`` must wait for that INIT (not
    fail at once with ``PeerDead``, which would then have refused the INIT as a room the sender had ended)."""
    async with EmbeddingSender(LAYOUT, HB) as sender, raw_receiver(sender.address, LAYOUT, HB) as a, \
            raw_receiver(sender.address, LAYOUT, HB) as b:
        b.send(b.hello(LAYOUT, HB, receiver_id="B"))
        await b.expect(Welcome)
        outcome: list[BaseException | None] = []

        async def send() -> None:
            try:
                await sender.send("r", make_request(300, 1))
                outcome.append(None)
            except Exception as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(_keep_alive, b)
            await _declared_dead(sender, a, "r", "A")
            tg.start_soon(send)
            await anyio.sleep(0.05)
            b.send(Init(room="r", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=1))
            told = await b.expect(Status, timeout=5.0)
            assert isinstance(told, Status) and told.state is TransferStatus.SUCCESS, told
            with anyio.fail_after(5):
                while not outcome:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert outcome == [None]


async def test_a_rank_asking_after_another_ranks_session_was_dropped_is_served_with_it() -> None:
    """A two-rank room: rank 0 asked, then its session was dropped (silent) before rank 1 asked. Rank 1's INIT
    must open the room as usual, and rank 0, back in a new session, join it (a review found rank 1 answered
    ABORTED by the tombstone the drop left, and the room rank 0 opened again waiting for rank 1 until
    ``input_timeout``)."""
    async with EmbeddingSender(LAYOUT, HB) as sender, raw_receiver(sender.address, LAYOUT, HB) as a, \
            raw_receiver(sender.address, LAYOUT, HB) as b:
        for raw, name, rank in ((a, "A", 0), (b, "B", 1)):
            raw.send(raw.hello(LAYOUT, HB, receiver_id=name, rank=rank, world=2))
            await raw.expect(Welcome)
        init = Init(room="x", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_keep_alive, b)
            a.send(init)
            with anyio.fail_after(DEAD_WITHIN):
                while sender.rooms_in_flight == 0:
                    await anyio.sleep(0.01)
                while any("(A," in p for p in sender.peers):  # A silent: dropped, and room x with it
                    await anyio.sleep(0.01)
            b.send(init)  # rank 1 asks a moment later
            a.send(a.hello(LAYOUT, HB, receiver_id="A", rank=0, world=2, epoch=2))  # rank 0 back
            await a.expect(Welcome)
            tg.start_soon(_keep_alive, a, 20_000)
            a.send(init)  # and opens the room again
            with anyio.fail_after(5):
                await sender.send("x", make_request(300, 1))
            for raw in (a, b):
                told = await raw.expect(Status)
                assert isinstance(told, Status) and told.state is TransferStatus.SUCCESS, told
            tg.cancel_scope.cancel()


async def test_a_room_its_receiver_asks_for_again_in_a_new_session_is_sent_after_the_drop() -> None:
    """The other order: the receiver whose session was dropped opens the room again in its next session (as a
    receiver does when the sender dropped it before any row came) before ``send()``. That INIT is the room's new
    request, not a late one: the tombstone the drop left must not refuse it, and the later ``send()`` is served."""
    async with EmbeddingSender(LAYOUT, HB) as sender, raw_receiver(sender.address, LAYOUT, HB) as raw:
        await _declared_dead(sender, raw, "r", "thawed-receiver")
        raw.send(raw.hello(LAYOUT, HB, receiver_id="thawed-receiver", epoch=2))
        await raw.expect(Welcome)

        async def keep_alive() -> None:
            for nonce in range(1, 1000):
                raw.send(Ping(nonce=nonce))
                await anyio.sleep(HB.heartbeat_interval / 2)

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_alive)
            raw.send(Init(room="r", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=1))
            with anyio.fail_after(5):
                while sender.rooms_in_flight == 0:
                    await anyio.sleep(0.01)
                async with anyio.create_task_group() as sending:
                    sending.start_soon(sender.send, "r", make_request(300, 1))
                    done = await raw.expect(Status)
                    assert isinstance(done, Status) and done.state is TransferStatus.SUCCESS, done.error
                    assert done.total_tokens == 300
            tg.cancel_scope.cancel()
        assert sender.rooms_in_flight == 0


async def test_a_room_failed_by_a_write_is_not_reported_as_a_dead_peer_when_another_rank_leaves_later() -> None:
    """A room of two ranks fails because its write to rank 1 failed (rank 1 is alive); while its write to rank 0 is
    still in flight, rank 0's session ends (the receiver shook hands again). ``send()`` raised ``PeerDead``, with
    the message of the failed write, because some rank's session had ended by then: a caller that retries
    elsewhere on ``PeerDead`` was misled. The first cause decides: ``TransferFailed``, naming the write."""
    cfg = HB.replace(heartbeat_interval=5.0, staging_tokens=0)
    rank_0, rank_1 = MockTransport(), MockTransport()

    def faults(call: WriteCall) -> WriteFault:
        if call.peer == f"loopback:{rank_1.id[:8]}":
            return WriteFault(error=TransportError("the link to rank 1 broke", may_land=False))
        return WriteFault(delay=1.0)  # rank 0's write is still in flight when rank 0's session ends

    async with EmbeddingSender(LAYOUT, cfg, transport=MockTransport(faults=faults)) as sender, \
            raw_receiver(sender.address, LAYOUT, cfg, transport=rank_0) as a, \
            raw_receiver(sender.address, LAYOUT, cfg, transport=rank_1) as b:
        for raw, name, rank in ((a, "A", 0), (b, "B", 1)):
            raw.send(raw.hello(LAYOUT, cfg, receiver_id=name, rank=rank, world=2))
            await raw.expect(Welcome)
        for raw in (a, b):
            raw.send(Init(room="x", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=2))
        errors: list[BaseException] = []

        async def send() -> None:
            try:
                await sender.send("x", make_request(500, 1))
            except TransferFailed as exc:
                errors.append(exc)

        with anyio.fail_after(5):
            while "x" not in sender._rooms or len(sender._rooms["x"].rank_peer) < 2:
                await anyio.sleep(0.01)
            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                while sender._rooms["x"].machine.failed is None:  # rank 1's write failed
                    await anyio.sleep(0.005)
                assert sender.writes_in_flight == 1  # rank 0's, still on its way
                a.send(a.hello(LAYOUT, cfg, receiver_id="A", rank=0, world=2, epoch=2))
                await a.expect(Welcome)  # rank 0's first session ended
                assert "receiver rank 0 (A, session 2)" in sender.peers
        (error,) = errors
        assert type(error) is TransferFailed, repr(error)
        assert "the link to rank 1 broke" in str(error) and error.room == "x"
        told = await b.expect(Status)
        assert isinstance(told, Status) and told.state is TransferStatus.FAILED
