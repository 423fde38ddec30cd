"""A copied round is written in chunks, two on the link at once, and copied out chunk by chunk as it lands.

``copy_chunk_tokens`` makes a copying receive (``receive()``, ``out=``) ask for ``PROGRESS`` within a
round; the sender posts the chunk writes two at a time and announces each in order; the receiver
copies each announced chunk while the next ones are still being written, and chunks announced together
in one go. A MockTransport with a fixed delay per write makes the timeline observable: when each write
was posted, when each copy ran.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
import torch

from aioembed import (
    EmbeddingReceiver,
    EmbeddingSender,
    PeerDead,
    TransferConfig,
    TransferError,
    TransferFailed,
    TransferStatus,
)
from aioembed.protocol.messages import Status
from aioembed.session import copy_out, receive_room
from aioembed.session.connection import LossKind, SessionLost
from aioembed.session.send_room import SendRoomDriver
from aioembed.testing import MockTransport, WriteCall, WriteFault

from .conftest import LAYOUT, assert_same, make_request, wait_pools_free

pytestmark = pytest.mark.anyio

BS = 16
CFG = TransferConfig(block_size=BS, default_tokens=1024, pool_tokens=2048, resume_reserve_tokens=0,
                     copy_chunk_tokens=4 * BS, staging_tokens=0, input_timeout=30.0, round_timeout=30.0)
DELAY = 0.15


class Timeline:
    """When each write was posted, and when each copy-out started and ended (``time.monotonic``)."""

    def __init__(self, fail_src: int | None = None) -> None:
        self.posted: list[tuple[float, int]] = []
        self.copies: list[tuple[float, float, int, int]] = []
        self.spread: list[bool] = []
        """Per copy: whether it could take every copy thread (a round's end) or one (a chunk within it)."""
        self.fail_src = fail_src
        """The write reading from this source address fails (the order in which the chunk writes reach
        the transport is the scheduler's)."""

    def faults(self, call: WriteCall) -> WriteFault:
        self.posted.append((time.monotonic(), call.nbytes))
        if any(op.src == self.fail_src for op in call.ops):
            return WriteFault(error=RuntimeError("the NIC dropped the link"), fail_after=1.5 * DELAY)
        return WriteFault(delay=DELAY)

    def spy_copies(self, receiver: EmbeddingReceiver) -> None:
        copier = receiver._room_ctx.copier  # type: ignore[union-attr]
        inner = copier.copy

        async def copy(blocks: Any, out: dict[str, torch.Tensor], start: int, count: int, **kw: Any) -> None:
            t0 = time.monotonic()
            await inner(blocks, out, start, count, **kw)
            self.copies.append((t0, time.monotonic(), start, count))
            self.spread.append(kw.get("spread", True))

        copier.copy = copy


def spans(line: Timeline) -> list[tuple[int, int]]:
    """``(start, count)`` of each copy-out, in order; checked to cover the request from token 0, gap-free."""
    got = [(s, c) for _, _, s, c in line.copies]
    assert all(s == (p + n) for (p, n), (s, _) in zip([(0, 0), *got], got, strict=False)), got
    return got


async def receive_failing(receiver: EmbeddingReceiver, errors: dict[str, BaseException]) -> None:
    """``receive("r")`` of a room expected to fail: its error goes to ``errors["receive"]``."""
    try:
        await receiver.receive("r")
    except TransferError as exc:
        errors["receive"] = exc


async def transfer(sender: EmbeddingSender, receiver: EmbeddingReceiver, want: dict[str, torch.Tensor],
                   **kw: Any) -> Any:
    """``receive("r", **kw)`` beside ``send("r", want)``; the received result."""
    got: dict[str, Any] = {}

    async def receive() -> None:
        got["r"] = await receiver.receive("r", **kw)

    async with anyio.create_task_group() as tg:
        tg.start_soon(receive)
        await sender.send("r", want)
    return got["r"]


async def test_a_copied_round_is_written_two_chunks_at_a_time_and_copied_as_it_lands() -> None:
    line = Timeline()
    want = make_request(10 * BS, 1)  # 160 tokens in chunks of 64: 64, 64, 32
    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport(faults=line.faults)) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, transport=MockTransport(), connect=sender.address) as receiver:
        line.spy_copies(receiver)
        got = await transfer(sender, receiver, want)
        assert_same(got.tensors, want)
        assert got.rounds == 1

        bpt = LAYOUT.bytes_per_token
        assert [n for _, n in line.posted] == [64 * bpt, 64 * bpt, 32 * bpt]
        t = [at for at, _ in line.posted]
        assert t[1] - t[0] < DELAY / 2, "the second chunk waits for the first: not pipelined"
        assert t[2] - t[0] >= DELAY - 0.01, "three chunk writes were on the link at once"
        # Chunks 0 and 1 land together: copied one after the other or, announced together, in one go; either
        # way in token order, and before the last chunk (still being written) landed.
        assert spans(line) in ([(0, 64), (64, 64), (128, 32)], [(0, 128), (128, 32)])
        assert line.copies[-2][1] < t[2] + DELAY
        assert line.spread == [False] * (len(line.copies) - 1) + [True]  # only the round's end takes every thread
        await wait_pools_free(sender, receiver)


async def test_out_and_resumed_rounds_are_copied_chunk_by_chunk() -> None:
    line = Timeline()
    cfg = CFG.replace(default_tokens=8 * BS)  # 200 tokens: a 128-token round, then a RESUME for 72
    want = make_request(200, 2)
    out = LAYOUT.empty(256)
    async with EmbeddingSender(LAYOUT, cfg, transport=MockTransport(faults=line.faults)) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, transport=MockTransport(), connect=sender.address) as receiver:
        line.spy_copies(receiver)
        got = await transfer(sender, receiver, want, out=out)
        assert got.rounds == 2
        assert_same(got.tensors, want)
        assert_same({n: t[:200] for n, t in out.items()}, want)
        # Each round's chunks land two at a time: copied one by one or together, never across a round's end.
        assert spans(line) in [first + second for first in ([(0, 64), (64, 64)], [(0, 128)])
                               for second in ([(128, 64), (192, 8)], [(128, 72)])]
        await wait_pools_free(sender, receiver)


async def test_a_failed_chunk_stops_the_round_and_no_later_chunk_is_posted() -> None:
    want = make_request(16 * BS, 3)  # 4 chunks; the second fails, cleanly (the mock is cancel-safe)
    line = Timeline(fail_src=want["embeddings"].data_ptr() + 4 * BS * LAYOUT["embeddings"].row_bytes)
    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport(faults=line.faults)) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, transport=MockTransport(), connect=sender.address) as receiver:
        line.spy_copies(receiver)
        errors: dict[str, BaseException] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_failing, receiver, errors)
            with pytest.raises(TransferFailed, match="dropped the link"):
                await sender.send("r", want)
        assert isinstance(errors["receive"], TransferFailed) and "dropped the link" in str(errors["receive"])
        # Chunks 0 and 1 went out together, chunk 2 when chunk 0 landed; chunk 1 failed before chunk 2 landed,
        # so chunk 3 was never posted.
        assert len(line.posted) == 3
        assert [(s, c) for _, _, s, c in line.copies] == [(0, 64)]
        await wait_pools_free(sender, receiver)


async def test_a_chunk_that_fails_before_the_one_ahead_of_it_lands_stops_the_round_at_once() -> None:
    """Chunk 1 fails while chunk 0 is still on the link: once chunk 0 has landed, the round ends there, and chunk 2
    is never posted (it used to be: the loop looked only at the room's state, and a chunk's failure is the round's
    until the round ends)."""
    want = make_request(16 * BS, 3)  # 4 chunks
    second = want["embeddings"].data_ptr() + 4 * BS * LAYOUT["embeddings"].row_bytes
    posted: list[int] = []

    def faults(call: WriteCall) -> WriteFault:
        posted.append(call.index)
        if any(op.src == second for op in call.ops):
            return WriteFault(error=RuntimeError("the NIC dropped the link"), fail_after=DELAY / 3)
        return WriteFault(delay=DELAY)

    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport(faults=faults)) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, transport=MockTransport(), connect=sender.address) as receiver:
        errors: dict[str, BaseException] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_failing, receiver, errors)
            with pytest.raises(TransferFailed, match="dropped the link"):
                await sender.send("r", want)
        assert isinstance(errors["receive"], TransferFailed)
        assert len(posted) == 2, "a chunk was posted after an earlier one had failed"
        await wait_pools_free(sender, receiver)


async def test_a_room_cancelled_mid_round_gets_no_further_chunk_and_keeps_its_blocks_until_its_writes_end(
        ) -> None:
    line = Timeline()
    want = make_request(16 * BS, 5)  # 4 chunks of 64 tokens
    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport(faults=line.faults)) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, transport=MockTransport(), connect=sender.address) as receiver:
        errors: dict[str, BaseException] = {}

        async def send() -> None:
            try:
                await sender.send("r", want)
            except TransferError as exc:
                errors["send"] = exc

        handle = receiver.start("r")
        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with anyio.fail_after(5):
                while len(line.posted) < 2:
                    await anyio.sleep(0.005)
            handle.cancel("the caller gave up")
            assert await handle.wait() is TransferStatus.ABORTED
            # Chunks 0 and 1 are still being written into the room's blocks: they stay out of the free list.
            assert receiver.allocator.stats.used > 0
        assert isinstance(errors["send"], TransferError), errors
        assert len(line.posted) == 2, "a chunk was posted after the room ended"
        await wait_pools_free(sender, receiver)


async def test_a_room_ending_when_a_chunk_is_announced_gets_no_further_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Announcing chunk 1 ends the room (as an ABORT arriving then would). Chunk 2 was already on the link
    (posted once chunk 0 landed); chunk 3 is never posted, and the sender ends the round without waiting
    for it (an earlier version, with a separate posting task, could wait forever here)."""
    posted: list[int] = []
    ended_at: list[int] = []

    def faults(call: WriteCall) -> WriteFault:
        posted.append(call.index)
        return WriteFault(delay=DELAY)

    announce = SendRoomDriver._announce_progress

    def announce_then_end(self: SendRoomDriver, task: Any, peer: Any, upto: int) -> bool:
        ok = announce(self, task, peer, upto)
        if ok and upto == 8 * BS:  # the end of chunk 1
            self.machine.fail("the encoder gave up on the request")
            ended_at.append(upto)
        return ok

    monkeypatch.setattr(SendRoomDriver, "_announce_progress", announce_then_end)
    want = make_request(16 * BS, 6)  # 4 chunks of 64 tokens
    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport(faults=faults)) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, transport=MockTransport(), connect=sender.address) as receiver:
        errors: dict[str, BaseException] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_failing, receiver, errors)
            with anyio.fail_after(10), pytest.raises(TransferError, match="gave up"):
                await sender.send("r", want)
        assert "gave up" in str(errors["receive"])
        assert ended_at == [8 * BS] and posted == [0, 1, 2], (ended_at, posted)
        await wait_pools_free(sender, receiver)


async def test_copy_chunk_tokens_zero_copies_each_round_whole() -> None:
    line = Timeline()
    cfg = CFG.replace(copy_chunk_tokens=0)
    want = make_request(10 * BS, 4)
    async with EmbeddingSender(LAYOUT, cfg, transport=MockTransport(faults=line.faults)) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, transport=MockTransport(), connect=sender.address) as receiver:
        line.spy_copies(receiver)
        got = await transfer(sender, receiver, want)
        assert_same(got.tensors, want)
        assert len(line.posted) == 1
        assert [(s, c) for _, _, s, c in line.copies] == [(0, 160)]
        await wait_pools_free(sender, receiver)


def parts_of_one_block(monkeypatch: pytest.MonkeyPatch) -> int:
    """A chunk that landed within its round is copied a block at a time (so a test sees the parts); the part
    size in tokens."""
    monkeypatch.setattr(receive_room, "CHUNK_PART_BYTES", BS * LAYOUT.bytes_per_token)
    return BS


def status_arrivals(monkeypatch: pytest.MonkeyPatch) -> anyio.Event:
    """Set once a STATUS is in a room's inbox."""
    arrived = anyio.Event()
    deliver = receive_room.ReceiveRoomDriver.deliver

    def spy_deliver(self: receive_room.ReceiveRoomDriver, event: Any) -> None:
        deliver(self, event)
        if isinstance(event, Status):
            arrived.set()

    monkeypatch.setattr(receive_room.ReceiveRoomDriver, "deliver", spy_deliver)
    return arrived


def slow_from(src: int) -> Callable[[WriteCall], WriteFault]:
    """Faults: the write reading from source address ``src`` (a round's last chunk) lands after a second,
    every other one at once (the order in which chunk writes reach the transport is the scheduler's)."""
    def faults(call: WriteCall) -> WriteFault:
        return WriteFault(delay=1.0 if any(op.src == src for op in call.ops) else 0.01)
    return faults


@contextlib.asynccontextmanager
async def pair_slow_from(src: int, cfg: TransferConfig = CFG) -> AsyncIterator[
        tuple[EmbeddingSender, EmbeddingReceiver, Timeline]]:
    """A sender whose write from ``src`` lands after a second (:func:`slow_from`), its receiver, and the
    receiver's copy-outs."""
    line = Timeline()
    async with EmbeddingSender(LAYOUT, cfg, transport=MockTransport(faults=slow_from(src))) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, transport=MockTransport(), connect=sender.address) as receiver:
        line.spy_copies(receiver)
        yield sender, receiver, line


def after_each_copy(receiver: EmbeddingReceiver, hook: Callable[[int], Awaitable[None]]) -> None:
    """``await hook(start)`` after each copy-out (``start``: its first token), inside the copy's await."""
    copier = receiver._room_ctx.copier  # type: ignore[union-attr]
    inner = copier.copy

    async def copy(blocks: Any, out: dict[str, torch.Tensor], start: int, count: int, **kw: Any) -> None:
        await inner(blocks, out, start, count, **kw)
        await hook(start)

    copier.copy = copy


@contextlib.asynccontextmanager
async def two_chunks_with_the_second_slow(monkeypatch: pytest.MonkeyPatch, seed: int) -> AsyncIterator[
        tuple[int, anyio.Event, dict[str, torch.Tensor], EmbeddingSender, EmbeddingReceiver, Timeline]]:
    """A one-round request of two 64-token chunks whose second lands late, chunks copied a block at a time:
    (part size, :func:`status_arrivals`, the request, and :func:`pair_slow_from`'s sender, receiver and
    timeline)."""
    part = parts_of_one_block(monkeypatch)
    status_in = status_arrivals(monkeypatch)
    want = make_request(8 * BS, seed)
    async with pair_slow_from(want["embeddings"][4 * BS].data_ptr()) as (sender, receiver, line):
        yield part, status_in, want, sender, receiver, line


async def test_rows_landing_during_a_chunk_copy_join_it_and_the_rest_takes_every_copy_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk is copied a part at a time on one thread; between parts the receiver looks for rows that landed
    meanwhile. Here the round's STATUS reaches the room while the chunk's first part is being copied: the rest
    of that chunk and the round's last rows are copied in one go, spread over the copy threads (copied one by
    one, the round's end would wait for the whole chunk on one thread)."""
    async with two_chunks_with_the_second_slow(monkeypatch, 7) as (part, status_in, want, sender, receiver, line):

        async def first_part_waits_for_the_status(start: int) -> None:
            if start == 0:
                with anyio.fail_after(10):
                    await status_in.wait()

        after_each_copy(receiver, first_part_waits_for_the_status)
        got = await transfer(sender, receiver, want)
        assert_same(got.tensors, want)
        assert spans(line) == [(0, part), (part, 8 * BS - part)]
        assert line.spread == [False, True]
        await wait_pools_free(sender, receiver)


async def test_a_resumed_rounds_chunk_is_copied_in_parts_at_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second round's first chunk lands long before the round's end: its parts go to the output rows of
    that round (offsets within the round's blocks, not the request's), then the round's end over every
    copy thread."""
    part = parts_of_one_block(monkeypatch)
    cfg = CFG.replace(default_tokens=8 * BS)  # 200 tokens: a 128-token round, then a RESUME for 72
    want = make_request(200, 9)
    out = LAYOUT.empty(256)
    async with pair_slow_from(want["embeddings"][192].data_ptr(), cfg) as (sender, receiver, line):
        got = await transfer(sender, receiver, want, out=out)
        assert got.rounds == 2
        assert_same(got.tensors, want)
        assert_same({n: t[:200] for n, t in out.items()}, want)
        second = [(s, c) for s, c in spans(line) if s >= 128]
        assert second == [(128 + i * part, part) for i in range(4)] + [(192, 8)]
        assert line.spread[-5:] == [False] * 4 + [True]
        await wait_pools_free(sender, receiver)


async def test_an_event_queued_behind_a_landed_chunk_waits_for_its_copy_and_nothing_is_folded_past_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's session is lost (gone silent) while a chunk that landed is being copied: the chunk's
    announced rows are still copied, part by part, the round's STATUS queued behind the loss is not folded in
    ahead of it, and then the loss ends the room, its blocks fenced until that STATUS, handed over as a late
    answer, proves the sender's writes over."""
    async with two_chunks_with_the_second_slow(monkeypatch, 8) as (part, status_in, want, sender, receiver, line):

        async def lose_the_session_after_the_first_part(start: int) -> None:
            if start == 0:
                driver = receiver._rooms["r"]
                assert isinstance(driver, receive_room.ReceiveRoomDriver) and driver.writer is not None
                driver.deliver(SessionLost(kind=LossKind.SILENT, reason="test: the sender went silent",
                                           writer=driver.writer))
                with anyio.fail_after(10):
                    await status_in.wait()  # the round's STATUS is now queued behind the loss

        after_each_copy(receiver, lose_the_session_after_the_first_part)
        errors: dict[str, BaseException] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(receive_failing, receiver, errors)
            with anyio.fail_after(10):
                await sender.send("r", want)  # the sender never learns: its writes and STATUS went out
        assert isinstance(errors["receive"], PeerDead) and "went silent" in str(errors["receive"])
        assert spans(line) == [(0, part), (part, part), (2 * part, part), (3 * part, part)]
        assert line.spread == [False] * 4
        await wait_pools_free(sender, receiver)


async def test_a_round_shorter_than_its_reservation_is_copied_out_over_every_copy_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A round's end is copied out spread over the copy threads, by whole blocks. The grant holds the whole
    reservation (``default_tokens``), whatever the rows: split by its blocks, the parts past the rows had nothing
    to copy, and a request a quarter of its reservation was copied by one thread of four."""
    monkeypatch.setattr(copy_out, "COPY_INLINE_BYTES", BS * LAYOUT.bytes_per_token)  # a block is a large copy
    cfg = CFG.replace(copy_threads=4, copy_chunk_tokens=0)
    tokens = 16 * BS  # a quarter of the 64-block reservation
    want = make_request(tokens, 11)
    async with EmbeddingSender(LAYOUT, cfg) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected()
        inner = receiver.pool.copy_out
        copied: list[int] = []  # rows per call

        def spy(blocks: Any, num_tokens: int, out: Any, *, out_start: int) -> None:
            copied.append(num_tokens)
            inner(blocks, num_tokens, out, out_start=out_start)

        monkeypatch.setattr(receiver.pool, "copy_out", spy)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "r", want)
            got = await receiver.receive("r")
        assert_same(got.tensors, want)
        assert copied == [4 * BS] * 4, copied
        await wait_pools_free(sender, receiver)
