"""One pool, many encoders: a receiver takes rooms (and parts of rooms) from any number of senders.

Three senders and two receivers, each receiver with one pool: rooms from any sender, rooms
assembled from parts sent by two or three senders (resumed within each part), bit for bit; one
sender failing touches only its rooms and parts; memory is shared first come, first served.
"""

from __future__ import annotations

import functools
import itertools
import random
import socket
from contextlib import AsyncExitStack, suppress
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from aioembed import (
    EmbeddingReceiver,
    EmbeddingSender,
    InvalidRequest,
    Part,
    TransferAborted,
    TransferConfig,
    TransferError,
    TransferFailed,
    TransferStatus,
)
from aioembed.metrics import TransferObserver
from aioembed.session.assembly import RoomAssembly
from aioembed.session.handle import ReceiveHandle
from aioembed.testing import MockTransport

from .conftest import LAYOUT, assert_same, make_request, wait_pools_free

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, max_round_tokens=1024, pool_tokens=16384, resume_reserve_tokens=1024,
                     input_timeout=30.0, round_timeout=30.0)


def split(total: int, senders: list[str], rng: random.Random) -> list[Part]:
    cuts = sorted(rng.sample(range(1, total), len(senders) - 1))
    bounds = [0, *cuts, total]
    return [Part(s, a, b) for s, (a, b) in zip(senders, itertools.pairwise(bounds), strict=True)]


def rows(src: dict[str, torch.Tensor], part: Part) -> dict[str, torch.Tensor]:
    return {n: t[part.start:part.end].contiguous() for n, t in src.items()}


async def test_three_senders_two_receivers_rooms_and_parts_bit_for_bit() -> None:
    rng = random.Random(18)
    async with AsyncExitStack() as stack:
        senders = [await stack.enter_async_context(EmbeddingSender(LAYOUT, CFG)) for _ in range(3)]
        receivers = [await stack.enter_async_context(EmbeddingReceiver(LAYOUT, CFG)) for _ in range(2)]
        plans: list[dict[str, Any]] = []
        for i in range(64):
            total = rng.randint(300, 4000)
            chosen = rng.sample(range(3), rng.choice([1, 1, 2, 3]))
            plans.append({"room": f"r{i}", "receiver": receivers[i % 2], "src": make_request(total, i),
                          "senders": chosen, "total": total})
        results: dict[str, Any] = {}

        async def receive(plan: dict[str, Any]) -> None:
            r: EmbeddingReceiver = plan["receiver"]
            if len(plan["senders"]) == 1:
                results[plan["room"]] = await r.receive(plan["room"], sender=senders[plan["senders"][0]].address)
            else:
                plan["parts"] = split(plan["total"], [senders[k].address for k in plan["senders"]], rng)
                results[plan["room"]] = await r.receive(plan["room"], parts=plan["parts"])

        async def send(plan: dict[str, Any]) -> None:
            if len(plan["senders"]) == 1:
                await senders[plan["senders"][0]].send(plan["room"], plan["src"], {"room": plan["room"]})
                return
            while "parts" not in plan:  # the language side splits the request (known to it from the request)
                await anyio.sleep(0.001)
            async with anyio.create_task_group() as tg:
                for i, (k, part) in enumerate(zip(plan["senders"], plan["parts"], strict=True)):
                    tg.start_soon(lambda k=k, part=part, i=i: senders[k].send(
                        plan["room"], rows(plan["src"], part), {f"image{i}": [part.start, part.end]}, part=i))

        async with anyio.create_task_group() as tg:
            for plan in plans:
                tg.start_soon(receive, plan)
                tg.start_soon(send, plan)
        split_rooms = 0
        for plan in plans:
            got = results[plan["room"]]
            assert_same(got.tensors, plan["src"])
            if len(plan["senders"]) > 1:
                split_rooms += 1
                assert len(got.part_metadata) == len(plan["senders"])
                assert got.metadata == {f"image{i}": [p.start, p.end] for i, p in enumerate(plan["parts"])}
                assert got.rounds >= max(-(-p.tokens // CFG.round_tokens) for p in plan["parts"])
        assert split_rooms >= 20
        assert sorted(receivers[0].senders) == sorted(s.address for s in senders)  # one connection per sender
        for s in senders:
            await wait_pools_free(s, *receivers)


async def test_a_failing_sender_fails_only_its_rooms_and_parts_naming_it() -> None:
    bad_transport = MockTransport(raise_on={"write": RuntimeError("the encoder's NIC died")})
    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport()) as good, \
            EmbeddingSender(LAYOUT, CFG, transport=bad_transport) as bad, \
            EmbeddingReceiver(LAYOUT, CFG, transport=MockTransport()) as receiver:
        full = make_request(3000, 1)
        parts = [Part(good.address, 0, 1000), Part(bad.address, 1000, 3000)]
        alone = make_request(2000, 2)
        outcome: dict[str, Any] = {}

        async def receive(room: str, **kw: Any) -> None:
            try:
                outcome[room] = await receiver.receive(room, **kw)
            except TransferError as exc:
                outcome[room] = exc

        async def quietly(coro: Any) -> None:
            with suppress(TransferError):
                await coro

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: receive("split", parts=parts))
            tg.start_soon(lambda: receive("good", sender=good.address))
            tg.start_soon(lambda: receive("bad", sender=bad.address))
            tg.start_soon(quietly, good.send("split", rows(full, parts[0]), part=0))
            tg.start_soon(quietly, bad.send("split", rows(full, parts[1]), part=1))
            tg.start_soon(good.send, "good", alone)
            tg.start_soon(quietly, bad.send("bad", make_request(500, 3)))
        assert_same(outcome["good"].tensors, alone)  # the other sender's room is untouched
        for room in ("split", "bad"):
            err = outcome[room]
            assert isinstance(err, TransferFailed), err
            assert bad.address in str(err) and "the encoder's NIC died" in str(err)
        assert "part 1 (tokens 1000..3000)" in str(outcome["split"])
        del bad_transport.raise_on["write"]
        async with anyio.create_task_group() as tg:  # and the failing sender serves again once it is well
            tg.start_soon(bad.send, "again", alone)
            got = await receiver.receive("again", sender=bad.address)
        assert_same(got.tensors, alone)
        await wait_pools_free(good, receiver)


async def test_memory_goes_to_rooms_in_the_order_they_asked_across_senders() -> None:
    """Rooms from a busy sender cannot starve a quiet sender's room: reservations are first come,
    first served across all senders (one room at a time fits this pool)."""
    cfg = CFG.replace(pool_tokens=2048, default_tokens=1024, resume_reserve_tokens=1024)
    async with EmbeddingSender(LAYOUT, cfg) as busy, EmbeddingSender(LAYOUT, cfg) as quiet, \
            EmbeddingReceiver(LAYOUT, cfg) as receiver:
        order: list[str] = []

        async def receive(room: str, sender: EmbeddingSender) -> None:
            await receiver.receive(room, sender=sender.address, expected_tokens=1024)
            order.append(room)

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(receive, f"busy{i}", busy)
                await anyio.sleep(0.02)  # they ask in this order
                if i == 1:
                    tg.start_soon(receive, "quiet", quiet)
                    await anyio.sleep(0.02)
            await anyio.sleep(0.1)
            for i in range(6):  # the busy encoder answers its rooms first...
                tg.start_soon(busy.send, f"busy{i}", make_request(1024, i))
            await anyio.sleep(0.2)
            tg.start_soon(quiet.send, "quiet", make_request(1024, 99))  # ...the quiet one later
        # The quiet room asked third: it got memory third, and nothing asked after it went first.
        assert order.index("quiet") <= 3, order
        assert set(order[:2]) == {"busy0", "busy1"}, order


async def test_connections_are_bounded_and_idle_ones_close() -> None:
    cfg = CFG.replace(max_senders=2, sender_idle_timeout=0.3)
    async with AsyncExitStack() as stack:
        senders = [await stack.enter_async_context(EmbeddingSender(LAYOUT, cfg)) for _ in range(3)]
        receiver = await stack.enter_async_context(EmbeddingReceiver(LAYOUT, cfg))
        for s in senders[:2]:
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.send, "r", make_request(100, 1))
                await receiver.receive("r", sender=s.address)
        assert len(receiver.senders) == 2
        async with anyio.create_task_group() as tg:  # a third sender: the least recently used idle one goes
            tg.start_soon(senders[2].send, "r", make_request(100, 1))
            await receiver.receive("r", sender=senders[2].address)
        assert senders[0].address not in receiver.senders and len(receiver.senders) == 2
        with anyio.fail_after(3):  # idle ones close after sender_idle_timeout
            while receiver.senders:
                await anyio.sleep(0.05)
        # Busy connections are never closed to make room: the caller is told.
        h1 = receiver.start("a", sender=senders[0].address)
        h2 = receiver.start("b", sender=senders[1].address)
        with pytest.raises(InvalidRequest, match="max_senders"):
            receiver.start("c", sender=senders[2].address)
        h1.cancel()
        h2.cancel()


async def test_a_room_started_as_its_idle_connection_closes_gets_a_new_connection() -> None:
    # The idle timer decides to close a connection; its tasks end a few loop turns later. A room started in
    # between got the dying connection: its INIT went to a closed socket, and the room kept its blocks and
    # its id for good (found by a reviewer).
    cfg = CFG.replace(sender_idle_timeout=0.2)
    async with EmbeddingSender(LAYOUT, cfg) as s, EmbeddingReceiver(LAYOUT, cfg) as receiver:
        await receiver.wait_connected(sender=s.address)
        conn = receiver._conns[s.address]
        with anyio.fail_after(5):
            while not conn.stop_scope.cancel_called:
                await anyio.lowlevel.checkpoint()
        src = make_request(700, 3)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.send, "late", src)
                got = await receiver.receive("late", sender=s.address)
        assert_same(got.tensors, src)
        assert receiver._conns[s.address] is not conn and conn.closed
        await wait_pools_free(s, receiver)


async def test_a_room_on_a_connection_closed_under_it_fails_at_once_and_fences_its_blocks() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as s, EmbeddingReceiver(LAYOUT, CFG) as receiver:
        handle = receiver.start("r", sender=s.address)
        with anyio.fail_after(5):
            while handle.status is not TransferStatus.WAITING_FOR_INPUT:  # INIT sent
                await anyio.sleep(0.005)
        conn = receiver._conns.pop(s.address)
        conn.stop_scope.cancel()  # closing it, as an idle close or the receiver's own close does
        with anyio.fail_after(5):  # not the 30 s input_timeout
            await handle.wait()
        with pytest.raises(TransferFailed, match="was closed"):
            await handle.result()
        assert receiver.rooms_in_flight == 0 and not conn.rooms and conn.closed
        # The sender had the room's INIT: a write of it may still reach those blocks, so they stay fenced.
        fenced = receiver.fenced_blocks
        assert set(fenced) == {"session_dropped"} and fenced["session_dropped"] > 0
        st = receiver.allocator.stats
        assert st.free + st.fenced == st.total


async def test_parts_that_cannot_all_start_fail_the_call_and_leave_nothing() -> None:
    # A part's driver that could not be set up (here: no connection free under max_senders) killed the
    # room's task: receive(parts=...) waited for ever, and the parts started before it went on.
    cfg = CFG.replace(max_senders=1)
    async with EmbeddingSender(LAYOUT, cfg) as a, EmbeddingSender(LAYOUT, cfg) as b, \
            EmbeddingReceiver(LAYOUT, cfg) as receiver:
        with pytest.raises(InvalidRequest, match="max_senders"):
            receiver.start("room", parts=[Part(a.address, 0, 100), Part(b.address, 100, 300)])
        assert receiver.rooms_in_flight == 0 and all(not c.rooms for c in receiver._conns.values())
        parts = [Part(a.address, 0, 100), Part(a.address, 100, 300)]  # the same id again, one sender
        src = make_request(300, 4)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i, part in enumerate(parts):
                    tg.start_soon(functools.partial(a.send, "room", rows(src, part), part=i))
                got = await receiver.receive("room", parts=parts)
        assert_same(got.tensors, src)
        await wait_pools_free(a, receiver)


@pytest.mark.parametrize("copy_chunk_tokens", [0, 128], ids=["whole_rounds", "in_chunks"])
@pytest.mark.parametrize("sent", [2500, 10], ids=["too_long", "too_short"])
@pytest.mark.parametrize("send_first", [True, False], ids=["send_first", "init_first"])
async def test_a_part_with_the_wrong_length_fails_on_both_sides_naming_both_counts(
        copy_chunk_tokens: int, sent: int, send_first: bool) -> None:
    """The part's INIT says its length: the sender fails a send() of another length before writing a row, and
    tells the receiver why. (A short part used to fit the first reservation: send() succeeded while the
    receiver failed the room, and the encoder never learnt.)"""
    cfg = CFG.replace(copy_chunk_tokens=copy_chunk_tokens)
    async with EmbeddingSender(LAYOUT, cfg) as a, EmbeddingSender(LAYOUT, cfg) as b, \
            EmbeddingReceiver(LAYOUT, cfg) as receiver:
        parts = [Part(a.address, 0, 500), Part(b.address, 500, 1500)]
        sent_error: list[BaseException] = []

        async def send_part_1() -> None:
            if not send_first:
                with anyio.fail_after(5):
                    while ("r", 1) not in b._rooms:  # its INIT is in
                        await anyio.sleep(0.005)
            try:
                await b.send("r", make_request(sent, 2), part=1)  # not 1000 tokens
            except TransferFailed as exc:
                sent_error.append(exc)

        async def quietly(coro: Any) -> None:
            with suppress(TransferError):
                await coro

        async with anyio.create_task_group() as tg:
            tg.start_soon(quietly, a.send("r", make_request(500, 1), part=0))
            tg.start_soon(send_part_1)
            if send_first:
                await anyio.sleep(0.05)
            with pytest.raises(TransferFailed, match=f"send\\(\\) gave {sent} tokens for a part .* exactly 1000"):
                await receiver.receive("r", parts=parts)
        assert len(sent_error) == 1 and "exactly 1000 tokens" in str(sent_error[0])
        await wait_pools_free(a, receiver)
        await wait_pools_free(b, receiver)


async def test_parts_are_checked() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as s, EmbeddingReceiver(LAYOUT, CFG) as receiver:
        for parts, match in (([], "1.."), ([Part(s.address, 0, 10), Part(s.address, 20, 30)], "gaps"),
                             ([Part(s.address, 5, 10)], "start at 0"), ([Part("", 0, 10)], "sender")):
            with pytest.raises(InvalidRequest, match=match):
                receiver.start("r", parts=parts)
        with pytest.raises(InvalidRequest, match="drop sender"):
            receiver.start("r", parts=[Part(s.address, 0, 10)], sender=s.address)
        for bad in (Part(s.address, 0, 10.0), Part(s.address, False, 10), Part(s.address, 0, "10")):  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match="bounds must be integers"):
                receiver.start("r", parts=[bad])
        with pytest.raises(InvalidRequest, match="part index"):
            await s.send("r", make_request(10, 1), part=-1)


async def test_parts_with_numpy_bounds_and_their_status() -> None:
    """Bounds from a prefix sum (numpy integers) are taken as ints; the room's status follows its parts."""
    async with EmbeddingSender(LAYOUT, CFG) as a, EmbeddingSender(LAYOUT, CFG) as b, \
            EmbeddingReceiver(LAYOUT, CFG) as receiver:
        cuts = np.cumsum([0, 300, 200])
        parts = [Part(a.address, cuts[0], cuts[1]), Part(b.address, cuts[1], cuts[2])]
        src = make_request(500, 4)
        handle = receiver.start("n", parts=parts)
        assert handle.status is TransferStatus.BOOTSTRAPPING
        with anyio.fail_after(5):
            while handle.status is not TransferStatus.WAITING_FOR_INPUT:  # both parts asked their senders
                await anyio.sleep(0.005)
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(a.send, "n", {n: t[:300] for n, t in src.items()}, part=0))
            tg.start_soon(functools.partial(b.send, "n", {n: t[300:] for n, t in src.items()}, part=1))
            got = await handle.result()
        assert handle.status is TransferStatus.SUCCESS
        assert_same(got.tensors, src)


class Counting(TransferObserver):
    def __init__(self) -> None:
        self.by_sender: dict[tuple[str, str], int] = {}

    def sender_room_finished(self, *, sender: str, outcome: str, nbytes: int) -> None:
        self.by_sender[sender, outcome] = self.by_sender.get((sender, outcome), 0) + 1


async def test_metrics_per_sender() -> None:
    observer = Counting()
    async with EmbeddingSender(LAYOUT, CFG) as a, EmbeddingSender(LAYOUT, CFG) as b, \
            EmbeddingReceiver(LAYOUT, CFG, observer=observer) as receiver:
        parts = [Part(a.address, 0, 300), Part(b.address, 300, 900)]
        src = make_request(900, 5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: a.send("r", rows(src, parts[0]), part=0))
            tg.start_soon(lambda: b.send("r", rows(src, parts[1]), part=1))
            tg.start_soon(lambda: a.send("s", src))
            await receiver.receive("r", parts=parts)
            await receiver.receive("s", sender=a.address)
        assert observer.by_sender == {(a.address, "success"): 2, (b.address, "success"): 1}


async def test_a_parts_room_cancelled_from_outside_still_resolves_its_handle() -> None:
    """The receiver's close cancels the tasks still running after its grace; the assembly's task ended
    without resolving the room's handle, and a ``receive(parts=...)`` caller waited for ever."""
    handle = ReceiveHandle("r")
    handle._scope = anyio.CancelScope()
    part_handles = [ReceiveHandle(("r", 0)), ReceiveHandle(("r", 1))]  # parts that never end on their own
    parts = [Part("tcp://a", 0, 10), Part("tcp://b", 10, 20)]
    asm = RoomAssembly("r", handle, parts, part_handles, zero_copy=False, output=None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(asm.run)
        await anyio.wait_all_tasks_blocked()
        tg.cancel_scope.cancel()  # as the receiver's cancel_all() does
    assert handle.done and handle.status is TransferStatus.ABORTED
    with pytest.raises(TransferAborted, match="receiver closed"):
        await handle.result()
    assert all(h._cancel_reason for h in part_handles)


async def test_a_connection_awaited_by_wait_connected_is_not_closed_to_make_room() -> None:
    """A connection whose handshake ``wait_connected()`` awaits has no room, but it is in use: closing it to make
    room under ``max_senders`` failed that wait with "the connection ... was closed" (the caller never learnt why).
    It counts as busy: the other start() is told, as for any full table, and the wait goes on."""
    cfg = CFG.replace(max_senders=1)
    with socket.socket() as probe:  # a port nothing listens on: that handshake never completes
        probe.bind(("127.0.0.1", 0))
        silent = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    async with EmbeddingSender(LAYOUT, cfg) as s, EmbeddingReceiver(LAYOUT, cfg) as receiver:
        outcome: list[BaseException] = []

        async def wait() -> None:
            try:
                await receiver.wait_connected(30, sender=silent)
            except Exception as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            with anyio.fail_after(5):
                while receiver.senders != [silent]:
                    await anyio.lowlevel.checkpoint()
            with pytest.raises(InvalidRequest, match="max_senders"):
                receiver.start("r", sender=s.address)
            await anyio.sleep(0.1)  # a closed connection ends its waiter within a few loop turns
            assert not outcome, outcome
            tg.cancel_scope.cancel()
        # Once nobody waits, that connection is idle again: it goes to make room.
        src = make_request(300, 5)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.send, "r", src)
                got = await receiver.receive("r", sender=s.address)
        assert_same(got.tensors, src)
        assert receiver.senders == [s.address]
        await wait_pools_free(s, receiver)


async def test_a_connection_whose_sender_only_has_leased_blocks_is_idle() -> None:
    """A lease's blocks are readable: their writer said its writes ended, so no write of that sender can reach
    them. Counting them as blocks "its sender may still write" kept the connection busy for as long as the
    lease was held: with ``max_senders`` connections each holding a lease, a room from another sender was
    refused (``InvalidRequest``, blaming "fenced blocks" that did not exist). The connection closes; the lease
    still reads its rows, and its release gives the blocks back once."""
    cfg = CFG.replace(max_senders=1, sender_idle_timeout=0.2)
    async with EmbeddingSender(LAYOUT, cfg) as a, EmbeddingSender(LAYOUT, cfg) as b, \
            EmbeddingReceiver(LAYOUT, cfg) as receiver:
        src_a, src_b = make_request(1500, 1), make_request(300, 2)  # a's room in two rounds
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.send, "a", src_a)
                lease = await receiver.receive_leased("a", sender=a.address)
        held = receiver.allocator.stats.total - receiver.allocator.stats.free
        assert held > 0
        with anyio.fail_after(10):  # not refused: a's connection holds nothing a write may reach
            async with anyio.create_task_group() as tg:
                tg.start_soon(b.send, "b", src_b)
                got = await receiver.receive("b", sender=b.address)
        assert_same(got.tensors, src_b)
        assert receiver.senders == [b.address]
        assert_same(lease.to_tensors(), src_a)  # nothing freed or written under the lease
        assert receiver.allocator.stats.total - receiver.allocator.stats.free == held
        with anyio.fail_after(5):  # and the idle timer closes b's connection too, the lease still held
            while receiver.senders:
                await anyio.sleep(0.02)
        assert_same(lease.to_tensors(), src_a)
        lease.release()
        lease.release()
        await wait_pools_free(a, receiver)
        await wait_pools_free(b, receiver)
        assert len(receiver.keeper.ledger) == 0
