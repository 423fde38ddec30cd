"""What a receiver hands back: a handle on a room in flight, and the received request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from aioembed.errors import TransferError
from aioembed.protocol.messages import RoomId
from aioembed.protocol.room import TransferStatus

__all__ = ["Lease", "ReceiveHandle", "Received", "TransferStats"]


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


class Lease:
    """A request received zero-copy: per field, views of pool blocks in token order.

    The views stay valid until :meth:`release`; after it the blocks go to other rooms and the
    views must not be read. Use ``async with lease:`` (or ``with lease:``) to release on exit.
    """

    def __init__(self, *, room: RoomId, views: dict[str, list[torch.Tensor]], metadata: dict[str, Any],
                 num_tokens: int, rounds: int, stats: TransferStats, release: Callable[[], None]) -> None:
        self.room = room
        self.views = views
        self.metadata = metadata
        self.num_tokens = num_tokens
        self.rounds = rounds
        self.stats = stats
        self._release: Callable[[], None] | None = release

    @property
    def released(self) -> bool:
        """True once the blocks went back to the pool."""
        return self._release is None

    def release(self) -> None:
        """Give the blocks back to the pool (idempotent)."""
        if self._release is not None:
            release, self._release = self._release, None
            self.views = {name: [] for name in self.views}
            release()

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Contiguous copies of every field (what ``receive()`` would have returned)."""
        if self._release is None:
            raise TransferError(f"room {self.room!r}: lease already released", room=self.room)
        return {name: torch.cat(vs) if len(vs) != 1 else vs[0].clone() for name, vs in self.views.items()}

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


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

    @property
    def status(self) -> TransferStatus:
        """Current state; never blocks."""
        return self._status

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
        if self._error is not None:
            raise self._error
        if not isinstance(self._result, Received):
            raise TransferError(f"room {self.room!r} was received zero-copy: use lease()", room=self.room)
        return self._result

    async def lease(self) -> Lease:
        """For a room started with ``zero_copy=True``: wait and return its :class:`Lease`."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        if not isinstance(self._result, Lease):
            raise TransferError(f"room {self.room!r} was not received zero-copy: use result()", room=self.room)
        return self._result

    def cancel(self, reason: str = "cancelled by the receiver") -> None:
        """Abort the room on both sides. Returns at once; ``wait()`` tells when it is over."""
        if self._done.is_set():
            return
        self._cancel_reason = reason
        if self._scope is not None:
            self._scope.cancel()

    # -- used by the receiver ------------------------------------------------------------

    def _set_status(self, status: TransferStatus) -> None:
        if not self._done.is_set():
            self._status = status

    def _finish(self, *, result: Received | Lease | None = None, error: TransferError | None = None,
                status: TransferStatus) -> None:
        if self._done.is_set():
            return
        self._result, self._error, self._status = result, error, status
        self._done.set()
