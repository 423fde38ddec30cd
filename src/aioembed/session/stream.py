"""Streaming receive: rows handed to the caller as they land, in token order, before the last byte.

``receiver.stream(room)`` returns a :class:`RoomStream`; iterating it yields chunks that together
cover every token of the room exactly once, in order. A chunk is yielded only once its rows have
landed *and* the sender said so (``PROGRESS`` within a round, ``STATUS`` at its end): data is
visible before it is announced. Two flavours, like the whole-room API:

* copying (:class:`Chunk`): ``chunk.tensors`` are views of one output the receiver allocated once
  the room's total was known (or of ``out=``): the caller owns them, nothing to release;
* zero-copy (:class:`LeasedChunk`, ``zero_copy=True``): ``chunk.views`` are views of pool blocks,
  a :class:`~aioembed.Lease` each. Release every chunk once consumed (``with chunk:``): the blocks
  of a round go back to the pool only when its chunks are released, so a caller that holds chunks
  holds pool memory; when the next round cannot get memory while this stream holds chunks, the
  receiver logs it and the room's timeout names it. A chunk dropped unreleased goes back through the
  lease's finalizer (the stream holds it weakly).

The room's metadata comes on every chunk (the sender gives it with its first announcement, so it is
there from the first chunk on). A failure mid-stream raises the room's
:class:`~aioembed.TransferError` after the chunks that had already landed, with
``error.delivered = (0, n)``: the tokens this iterator handed out. Leaving ``async with`` (or
``aclose()``) before the room completed aborts it on both sides and releases every leased chunk of
it, handed out or not; after a complete stream, leased chunks live until the caller releases them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream

from aioembed.errors import TransferError
from aioembed.protocol.messages import RoomId
from aioembed.session.handle import ReceiveHandle, TransferStats
from aioembed.session.lease import Lease, LeaseReturns

__all__ = ["Chunk", "LeasedChunk", "RoomStream", "StreamItem"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows ``[start, end)`` of a room, copied out: ``tensors`` (one per field) are the caller's."""

    room: RoomId
    start: int
    end: int
    total: int
    """The room's length in tokens."""
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> bool:
        """True for the chunk that ends the room."""
        return self.end == self.total


class LeasedChunk(Lease):
    """Rows ``[start, end)`` of a room, zero-copy: views of pool blocks until :meth:`release`."""

    def __init__(self, *, room: RoomId, start: int, end: int, total: int, views: dict[str, list[torch.Tensor]],
                 metadata: dict[str, Any], grants: list[int], returns: LeaseReturns) -> None:
        stats = TransferStats(bytes=0, rounds=0, seconds=0.0)
        super().__init__(room=room, views=views, metadata=metadata, num_tokens=end - start, rounds=0, stats=stats,
                         grants=grants, returns=returns)
        self.start = start
        self.end = end
        self.total = total

    @property
    def last(self) -> bool:
        """True for the chunk that ends the room."""
        return self.end == self.total

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<LeasedChunk room={self.room!r} tokens {self.start}..{self.end} of {self.total}, {state}>"


StreamItem = Chunk | LeasedChunk
ItemT = TypeVar("ItemT", Chunk, LeasedChunk, StreamItem)


class RoomStream(Generic[ItemT]):
    """The chunks of one room, in token order; see the module doc. Use ``async with`` around the loop."""

    def __init__(self, handle: ReceiveHandle, chunks: MemoryObjectReceiveStream[StreamItem]) -> None:
        self.handle = handle
        self._chunks = chunks
        self._delivered = 0
        self._held: list[weakref.ref[LeasedChunk]] = []
        """Chunks handed out, for aclose() to release; weakly, so that one the caller drops goes back through
        its finalizer (the stream must not keep it, and its blocks, alive)."""
        self._sent: list[LeasedChunk] = []  # sent by the room's driver, not yet handed out (see _release_lost)
        self._finished = False
        self._total: int | None = None

    @property
    def room(self) -> RoomId:
        return self.handle.room

    @property
    def delivered(self) -> int:
        """Tokens handed out so far (chunks ``[0, delivered)``)."""
        return self._delivered

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> ItemT:
        if self._finished:  # ended, or closed: what it ended with, again
            error = self.handle._error if self.handle.done else None
            if error is not None:
                raise error
            raise StopAsyncIteration
        try:
            chunk = await self._chunks.receive()
        except anyio.EndOfStream:
            await self.handle.wait()
            error = self.handle._error
            if error is not None:
                error.delivered = (0, self._delivered)
                raise error from None
            self._finished = True
            raise StopAsyncIteration from None
        except anyio.get_cancelled_exc_class():
            self.handle.cancel("stream() was cancelled")
            self._release_lost()  # asyncio drops an item handed to a receiver cancelled before it resumed
            raise
        if chunk.start != self._delivered:  # the driver delivers in order: anything else is a bug
            raise TransferError(f"room {self.room!r}: chunk {chunk.start}..{chunk.end} after "
                                f"{self._delivered} tokens", room=self.room)
        self._delivered = chunk.end
        self._total = chunk.total
        if isinstance(chunk, LeasedChunk):
            self._held = [r for r in self._held if (c := r()) is not None and not c.released]
            self._held.append(weakref.ref(chunk))
            self._sent = [c for c in self._sent if c.start >= self._delivered]
        return chunk  # type: ignore[return-value]  # the receiver's overloads tie ItemT to zero_copy

    async def aclose(self) -> None:
        """End the stream: a room not yet complete is aborted on both sides and every leased chunk of
        it is released (handed out or not). Idempotent."""
        # Every token handed out (a caller that breaks on ``chunk.last``) is a complete stream too: its
        # chunks are the caller's until released, whether or not the iterator saw the end.
        complete = self._total is not None and self._delivered == self._total
        if not self._finished and not complete:
            self.handle.cancel("the stream was closed before the room completed")
            with anyio.CancelScope(shield=True):
                await self.handle.wait()
            for r in self._held:
                if (c := r()) is not None:
                    c.release()
        self._held = []
        self._release_lost()
        self._sent = []
        while True:  # chunks never handed out (still buffered)
            try:
                left = self._chunks.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if isinstance(left, LeasedChunk):
                left.release()
        self._chunks.close()
        self._finished = True

    def _sent_chunk(self, chunk: LeasedChunk) -> None:
        """The room's driver sent ``chunk`` into this stream (it is this stream's to release until handed out)."""
        self._sent.append(chunk)

    def _release_lost(self) -> None:
        """Release the leased chunks sent and neither handed out nor still in the buffer: the one a ``receive()``
        cancelled after the chunk was handed to it dropped (asyncio's ``Task.cancel()``). The buffer holds the
        last ones sent, in order: a later ``__anext__`` hands those out, or ``aclose()`` releases them."""
        keep = len(self._sent) - self._chunks.statistics().current_buffer_used
        lost, self._sent = self._sent[:max(0, keep)], self._sent[max(0, keep):]
        for c in lost:
            if c.start >= self._delivered:
                c.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
