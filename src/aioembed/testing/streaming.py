"""Streaming receive, for any transport: chunks cover every token once, in order, bit for bit.

A plugin runs it by subclassing (compare :class:`~aioembed.testing.TransportConformance`)::

    from aioembed.testing.streaming import StreamingSuite

    class TestStreaming(StreamingSuite):
        transport_name = "mine"
        transport_options = {"protocol": "tcp"}
        backends = ("asyncio", "uvloop")  # if the transport is asyncio-only

Sender and receiver run in this process over the transport under test. The block size is odd on
purpose (13 tokens), rooms take 1, 2 and 11 rounds, chunks are announced within rounds and at their
ends, copying and zero-copy; then concurrency, a failure mid-stream, an early close, a cancelled
iterator and a caller holding too much of the pool. Every test ends with the pool whole again.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Any, ClassVar

import anyio
import pytest
import torch

from aioembed.config import TransferConfig
from aioembed.errors import TransferAborted, TransferError, TransferTimeout
from aioembed.protocol.messages import TransferStatus
from aioembed.samples import deterministic_request, standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.session.stream import Chunk, LeasedChunk, RoomStream
from aioembed.testing.event_loops import anyio_backends

__all__ = ["StreamingSuite"]

BS = 13
"""An odd block size: chunk and round boundaries never line up with powers of two."""
ROUND = 8 * BS
LAYOUT = standard_layout(32)


def _same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[n].contiguous().view(torch.uint8), want[n].contiguous().view(torch.uint8))
               for n in want)


async def consume(stream: RoomStream[Any], src: Mapping[str, torch.Tensor], *, release: bool = True) -> list[Any]:
    """Iterate ``stream``, checking each chunk against ``src`` (order, coverage, bytes); returns the chunks."""
    seen: list[Any] = []
    at = 0
    async for chunk in stream:
        assert chunk.start == at and chunk.end > chunk.start, (chunk, at)
        rows = chunk.tensors if isinstance(chunk, Chunk) else chunk.to_tensors()
        assert _same(rows, {n: t[chunk.start:chunk.end] for n, t in src.items()}), f"chunk {chunk} differs"
        at = chunk.end
        seen.append(chunk)
        if release and isinstance(chunk, LeasedChunk):
            chunk.release()
    total = next(iter(src.values())).shape[0]
    assert at == total, f"the chunks cover {at} of {total} tokens"
    return seen


async def send_quietly(sender: EmbeddingSender, room: str, src: Mapping[str, torch.Tensor]) -> None:
    """``send()`` of a room the test ends early: its ``TransferError`` is expected."""
    with suppress(TransferError):
        await sender.send(room, src)


class StreamingSuite:
    """Subclass with ``transport_name`` (and options) to run the streaming tests on a transport."""

    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [pytest.mark.anyio]
    transport_name: ClassVar[str]
    transport_options: ClassVar[Mapping[str, Any]] = {}
    backends: ClassVar[tuple[str, ...]] = ("asyncio", "uvloop", "trio")
    """Event loops by name (see :data:`~aioembed.testing.event_loops.EVENT_LOOPS`). uvloop is the loop of the
    inference servers a receiver lives in, and where a stream's cancellation paths (an item handed to a receiver
    cancelled before it resumed) behave as on asyncio: every loop by default, as in ``TransportConformance``.
    (Passed as raw ``anyio_backend`` values, the names left uvloop out: ``"uvloop"`` is no anyio backend.)"""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "anyio_backend" in metafunc.fixturenames:
            metafunc.parametrize("anyio_backend", anyio_backends(*self.backends))

    def config(self, **kw: Any) -> TransferConfig:
        base: dict[str, Any] = dict(
            transport=self.transport_name, transport_options=dict(self.transport_options), block_size=BS,
            default_tokens=ROUND, max_round_tokens=ROUND, pool_tokens=12 * ROUND, resume_reserve_tokens=ROUND,
            stream_chunk_tokens=3 * BS, input_timeout=30.0, round_timeout=30.0,
        )
        base.update(kw)
        return TransferConfig(**base)

    @asynccontextmanager
    async def pair(self, cfg: TransferConfig) -> AsyncIterator[tuple[EmbeddingSender, EmbeddingReceiver]]:
        async with EmbeddingSender(LAYOUT, cfg) as sender, \
                EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
            await receiver.wait_connected()
            yield sender, receiver
            with anyio.fail_after(15):  # every test leaves the pool whole
                await receiver.allocator.wait_all_free()
                # The room tables have no event of their own; they empty within a few loop turns.
                while sender.rooms_in_flight or receiver.rooms_in_flight:  # noqa: ASYNC110
                    await anyio.sleep(0.01)

    # -- coverage -------------------------------------------------------------------------

    @pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
    @pytest.mark.parametrize("rounds", [1, 2, 11])
    @pytest.mark.parametrize("chunk_tokens", [3 * BS, 0], ids=["within_rounds", "per_round"])
    async def test_chunks_cover_every_token_once_in_order(self, rounds: int, zero_copy: bool,
                                                          chunk_tokens: int) -> None:
        total = (rounds - 1) * ROUND + ROUND // 2 + 5  # the last round is partial, and not block-aligned
        src = deterministic_request(LAYOUT, total, f"s{rounds}")
        async with self.pair(self.config()) as (sender, receiver):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "room", src, {"rounds": rounds})
                async with receiver.stream("room", zero_copy=zero_copy, chunk_tokens=chunk_tokens) as stream:
                    chunks = await consume(stream, src)
            assert all(c.metadata == {"rounds": rounds} for c in chunks)  # from the first chunk on
            assert all(c.total == total for c in chunks) and chunks[-1].last
            if chunk_tokens:  # announced within rounds: every chunk is at most chunk_tokens
                assert max(c.end - c.start for c in chunks) <= chunk_tokens
                assert len(chunks) >= rounds + 1
            else:  # one chunk per round
                assert len(chunks) == rounds
            assert stream.handle.status.name == "SUCCESS" and stream.delivered == total

    async def test_streams_under_concurrency(self) -> None:
        rng = random.Random(16)
        cfg = self.config(pool_tokens=24 * ROUND)
        rooms = [(f"c{i}", rng.randint(1, 5 * ROUND), i % 2 == 1) for i in range(12)]
        async with self.pair(cfg) as (sender, receiver):
            async def one(room: str, tokens: int, zero_copy: bool) -> None:
                src = deterministic_request(LAYOUT, tokens, room)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender.send, room, src)
                    async with receiver.stream(room, zero_copy=zero_copy) as stream:
                        await consume(stream, src)

            async with anyio.create_task_group() as tg:
                for room in rooms:
                    tg.start_soon(one, *room)

    # -- failures -------------------------------------------------------------------------

    @pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
    async def test_failure_mid_stream_raises_after_the_delivered_chunks(self, zero_copy: bool) -> None:
        total = 6 * ROUND
        src = deterministic_request(LAYOUT, total, "f")
        async with self.pair(self.config()) as (sender, receiver):
            got: list[Any] = []
            error: list[TransferError] = []

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_quietly, sender, "f", src)
                async with receiver.stream("f", zero_copy=zero_copy) as stream:
                    try:
                        async for chunk in stream:
                            rows = chunk.tensors if isinstance(chunk, Chunk) else chunk.to_tensors()
                            assert _same(rows, {n: t[chunk.start:chunk.end] for n, t in src.items()})
                            got.append(chunk)
                            if len(got) == 2:  # the encoder gives up on the request mid-room
                                sender.abort("f", "the encoder ran out of memory")
                    except TransferError as exc:
                        error.append(exc)
            assert error, "the stream ended without the room's error"
            failure = error[0]
            assert isinstance(failure, TransferAborted) and "the encoder ran out of memory" in str(failure)
            assert failure.delivered == (0, got[-1].end) and 0 < got[-1].end < total
            if zero_copy:  # leaving the `async with` of an unfinished room released the chunks
                assert all(c.released for c in got)

    @pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
    async def test_closing_the_stream_early_releases_everything(self, zero_copy: bool) -> None:
        src = deterministic_request(LAYOUT, 5 * ROUND, "e")
        async with self.pair(self.config()) as (sender, receiver):
            held: list[Any] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_quietly, sender, "e", src)
                async with receiver.stream("e", zero_copy=zero_copy) as stream:
                    async for chunk in stream:
                        held.append(chunk)  # a zero-copy chunk is kept, not released
                        break
            assert held and stream.handle.status.name == "ABORTED"
            if zero_copy:
                assert all(c.released for c in held)
            with pytest.raises(TransferAborted):  # iterated again: how it ended, not anyio's ClosedResourceError
                await stream.__anext__()
            # the pair's exit checks that the allocator is back to 0 used

    @pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "zero_copy"])
    async def test_leaving_at_the_last_chunk_keeps_the_chunks(self, zero_copy: bool) -> None:
        """``if chunk.last: break`` is a complete stream: leaving ``async with`` then must not abort the room
        or release chunks the caller holds (it did: their views emptied, their blocks went to the next room)."""
        src = deterministic_request(LAYOUT, 3 * ROUND + 7, "l")
        async with self.pair(self.config()) as (sender, receiver):
            held: list[Any] = []
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "l", src)
                async with receiver.stream("l", zero_copy=zero_copy) as stream:
                    async for chunk in stream:
                        held.append(chunk)
                        if chunk.last:
                            break
            assert held[-1].last and stream.delivered == held[-1].total
            with anyio.fail_after(10):
                assert await stream.handle.wait() is TransferStatus.SUCCESS
            assert [c async for c in stream] == []  # a closed, complete stream is exhausted
            if zero_copy:  # each chunk holds the blocks of its rows, not the rest of its round's reservation
                assert receiver.allocator.stats.used == sum(-(-(c.end - c.start) // BS) for c in held)
            # the next room takes pool memory while the chunks are held: it must not take theirs
            other = deterministic_request(LAYOUT, 2 * ROUND, "l2")
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "l2", other)
                got = await receiver.receive("l2")
            assert _same(got.tensors, other)
            for chunk in held:
                rows = chunk.tensors if isinstance(chunk, Chunk) else chunk.to_tensors()
                assert _same(rows, {n: t[chunk.start:chunk.end] for n, t in src.items()}), f"chunk {chunk} changed"
                if isinstance(chunk, LeasedChunk):
                    assert not chunk.released
                    chunk.release()

    async def test_leaving_while_the_next_round_waits_for_memory_leaks_nothing(self) -> None:
        """A consumer that holds a chunk until the next round waits for pool memory, then releases it and
        leaves: the round's wait ends just as its blocks are granted. Those blocks were lost for good (no
        grant held them; found by a review): the pair's exit checks that the pool is whole."""
        cfg = self.config(pool_tokens=2 * ROUND, resume_reserve_tokens=0, round_timeout=10.0)
        for attempt in range(3):
            src = deterministic_request(LAYOUT, 5 * ROUND, f"w{attempt}")
            async with self.pair(cfg) as (sender, receiver):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_quietly, sender, "w", src)
                    kept: LeasedChunk | None = None
                    async with receiver.stream("w", zero_copy=True, chunk_tokens=0) as stream:
                        async for chunk in stream:
                            if kept is None:
                                kept = chunk  # held: the pool runs short two rounds on
                                continue
                            with anyio.fail_after(10):  # the next round waits for memory now
                                while receiver.allocator.stats.waiters == 0:  # noqa: ASYNC110
                                    await anyio.sleep(0.001)
                            kept.release()  # its blocks go to the waiting round ...
                            chunk.release()
                            break  # ... and the consumer leaves at once
                assert stream.handle.status is TransferStatus.ABORTED

    async def test_a_cancelled_iterator_aborts_the_room_and_releases_its_chunks(self) -> None:
        """The consumer keeps its chunks, so the next round waits for pool memory; the consumer's own
        deadline cancels it while it waits for the next chunk: the room is aborted on both sides and
        every chunk it held goes back to the pool."""
        cfg = self.config(pool_tokens=3 * ROUND, resume_reserve_tokens=ROUND)
        src = deterministic_request(LAYOUT, 6 * ROUND, "k")
        async with self.pair(cfg) as (sender, receiver):
            held: list[Any] = []
            outcome: list[BaseException] = []

            async def send() -> None:
                try:
                    await sender.send("k", src)
                except TransferAborted as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                with anyio.move_on_after(1.0) as deadline:
                    async with receiver.stream("k", zero_copy=True) as stream:
                        async for chunk in stream:
                            held.append(chunk)
            assert deadline.cancelled_caught and held
            assert stream.handle.status.name == "ABORTED"
            assert all(c.released for c in held)
            # What ended the room: the iterator's cancel, not the stream's close that followed it.
            assert outcome and "stream() was cancelled" in str(outcome[0]), outcome

    async def test_a_caller_holding_too_much_is_told_so(self) -> None:
        """Zero-copy chunks hold pool blocks: a caller that keeps them all starves the room's next round,
        and the room's timeout says why."""
        cfg = self.config(pool_tokens=3 * ROUND, resume_reserve_tokens=ROUND, round_timeout=1.5)
        src = deterministic_request(LAYOUT, 6 * ROUND, "h")
        async with self.pair(cfg) as (sender, receiver):
            kept: list[Any] = []
            error: list[TransferError] = []

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_quietly, sender, "h", src)
                async with receiver.stream("h", zero_copy=True) as stream:
                    try:
                        async for chunk in stream:
                            kept.append(chunk)  # never released
                    except TransferError as exc:
                        error.append(exc)
            assert error and isinstance(error[0], TransferTimeout), error
            assert "unreleased leased chunk" in str(error[0]) and "release chunks" in str(error[0])
            assert error[0].delivered == (0, kept[-1].end)
            assert all(c.released for c in kept)
