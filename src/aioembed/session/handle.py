"""What a receiver hands back: a handle on a room in flight, and the received request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch

from aioembed.errors import TransferAborted, TransferError
from aioembed.protocol.messages import RoomId, TransferStatus

if TYPE_CHECKING:
    from aioembed.session.lease import Lease
    from aioembed.session.stream import RoomStream, StreamItem

__all__ = ["ReceiveHandle", "Received", "TransferStats"]


@dataclass(frozen=True, slots=True)
class TransferStats:
    """Per-transfer numbers, for metrics and logs."""

    bytes: int
    """Payload bytes received (all fields)."""
    rounds: int
    """Rounds used (1 when the first reservation was enough)."""
    seconds: float
    """From ``start`` to the result."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase: ``handshake``, ``allocate``, ``wait`` (for data), ``copy``."""


@dataclass(frozen=True, slots=True)
class Received:
    """A complete request: one tensor per layout field, ``num_tokens`` rows each."""

    room: RoomId
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    num_tokens: int
    rounds: int
    stats: TransferStats
    part_metadata: tuple[dict[str, Any], ...] = ()
    """For a room received in parts: each part's metadata, in part order (``metadata`` merges them)."""


_PROGRESS = [TransferStatus.BOOTSTRAPPING, TransferStatus.WAITING_FOR_INPUT, TransferStatus.TRANSFERRING]


class ReceiveHandle:
    """A room being received. Non-blocking ``status`` for schedulers that poll; awaitables otherwise."""

    def __init__(self, room: RoomId) -> None:
        self.room = room
        self._status = TransferStatus.BOOTSTRAPPING
        self._done = anyio.Event()
        self._result: Received | Lease | None = None
        self._error: TransferError | None = None
        self._scope: anyio.CancelScope | None = None
        self._cancel_reason: str | None = None
        self._lease_taken = False
        self._stream: RoomStream[StreamItem] | None = None
        self._parts: list[ReceiveHandle] | None = None
        """A room received in parts: the parts' handles (its status until it ends is theirs)."""
        self._orphaned = False
        """A part of a room torn down (:meth:`_orphan`): nobody takes its result, a lease it ends with goes back."""

    @property
    def status(self) -> TransferStatus:
        """Current state; never blocks. For a room received in parts, until it ends: the least advanced
        state of the parts still going."""
        if self._parts is None or self._status.terminal:
            return self._status
        going = [h._status for h in self._parts if not h._status.terminal]
        return min(going, key=_PROGRESS.index) if going else TransferStatus.TRANSFERRING

    @property
    def done(self) -> bool:
        """True once the room reached a terminal state."""
        return self._done.is_set()

    async def wait(self) -> TransferStatus:
        """Wait until the room ends; returns its terminal status (does not raise)."""
        await self._done.wait()
        return self._status

    async def result(self) -> Received:
        """Wait for the room and return the request, or raise its :class:`TransferError`."""
        await self._done.wait()
        return self._ended_result()

    async def lease(self) -> Lease:
        """For a room started with ``zero_copy=True``: wait and return its :class:`Lease`."""
        await self._done.wait()
        return self._ended_lease()

    def _ended_result(self) -> Received:
        """:meth:`result` of a room that has ended (the receiver's own ``receive()`` drove it in the caller's
        task: returning without a wait saves the loop turn in which other tasks ran first)."""
        if self._error is not None:
            raise self._error
        if not isinstance(self._result, Received):
            raise TransferError(f"room {self.room!r} was received zero-copy: use lease()", room=self.room)
        return self._result

    def _ended_lease(self) -> Lease:
        """:meth:`lease` of a room that has ended (see :meth:`_ended_result`)."""
        if self._error is not None:
            raise self._error
        if isinstance(self._result, Received) or self._result is None:
            raise TransferError(f"room {self.room!r} was not received zero-copy: use result()", room=self.room)
        if self._result.released and not self._lease_taken:  # cancel() gave it back before anyone took it
            raise TransferAborted(f"room {self.room!r}: cancelled after it was received; its lease was given back",
                                  room=self.room)
        self._lease_taken = True
        return self._result

    def stream(self) -> RoomStream[StreamItem]:
        """For a room started with ``stream=True``: its chunks, in token order (use ``async with``)."""
        if self._stream is None:
            raise TransferError(f"room {self.room!r} was not started with stream=True", room=self.room)
        return self._stream

    def cancel(self, reason: str = "cancelled by the receiver") -> None:
        """Abort the room on both sides. Returns at once; ``wait()`` tells when it is over.

        On a room already received zero-copy whose lease nobody took, gives that lease back. A second
        cancel keeps the first reason: the error the caller sees and the ABORT the sender gets name what
        ended the room (as the sender's room keeps its first cause), not what came after.
        """
        if self._done.is_set():
            self._give_back_untaken()
            return
        if self._cancel_reason is None:
            self._cancel_reason = reason
        if self._scope is not None:
            self._scope.cancel()

    def _give_back_untaken(self) -> None:
        if self._result is not None and not isinstance(self._result, Received) and not self._lease_taken:
            self._result.release()

    # -- used by the receiver ------------------------------------------------------------

    def _set_status(self, status: TransferStatus) -> None:
        if not self._done.is_set():
            self._status = status

    def _orphan(self, reason: str) -> None:
        """Cancel a part whose room is torn down without waiting for it (its task was cancelled from outside:
        the receiver's close past its grace). Nobody will take its result, so a lease it ends with, now or
        later (its last frame may already be in hand), goes back at once, not at garbage collection."""
        self._orphaned = True
        self.cancel(reason)

    def _finish(self, *, result: Received | Lease | None = None, error: TransferError | None = None,
                status: TransferStatus) -> None:
        if self._done.is_set():
            return
        self._result, self._error, self._status = result, error, status
        self._done.set()
        if self._orphaned:
            self._give_back_untaken()
