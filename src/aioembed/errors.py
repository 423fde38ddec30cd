"""The one exception hierarchy of aioembed.

Every error the library raises derives from :class:`AioembedError`, so a server can catch
the library's failures in one place. Messages name what was expected, what came, and the
room / peer / setting involved.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

__all__ = [
    "AioembedError",
    "AllocationTimeout",
    "AllocatorError",
    "ConfigError",
    "IncompatiblePeer",
    "InvalidRequest",
    "LayoutError",
    "PeerDead",
    "PlanError",
    "ProtocolError",
    "TransferAborted",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
    "TransportError",
]

RoomId = int | str | tuple[int | str, int]


def room_prefix(room: RoomId | None) -> str:
    """``room 'x': ``, what a message about ``room`` starts with; empty where no room is concerned."""
    return "" if room is None else f"room {room!r}: "


class AioembedError(Exception):
    """Root of every error raised by aioembed."""


class ConfigError(AioembedError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class LayoutError(AioembedError, ValueError):
    """Tensors do not match the declared :class:`~aioembed.Layout`."""


class InvalidRequest(AioembedError, ValueError):
    """Arguments of a send or receive are out of range (too many tokens, metadata too large, ...)."""


class AllocatorError(AioembedError):
    """Misuse of a :class:`~aioembed.BlockAllocator` (double free, foreign ids, oversize)."""


class PlanError(AioembedError, ValueError):
    """A write plan's block lists cannot hold the token range asked for."""


class AllocationTimeout(AllocatorError, TimeoutError):
    """Free blocks did not become available before the deadline."""


class ProtocolError(AioembedError):
    """A control frame is malformed, or an event is illegal in the room's current state.

    ``room`` is set when the offending frame or event could be tied to a room, so the
    I/O layer can address the error to the right peer and room.
    """

    def __init__(self, message: str, *, room: RoomId | None = None) -> None:
        super().__init__(message)
        self.room = room
        self.peer_version: int | None = None
        """Set when the frame was well formed but spoke another protocol version."""


class TransportError(AioembedError):
    """A transport failed to register memory, connect, or write.

    ``may_land`` says whether a failed write may still reach its destination later: ``True``
    (unknown failure: fence), ``False`` (it never will), ``None`` (as the transport's
    ``cancel_safe_writes`` capability says).

    ``settled``, for a write that may still land: a coroutine function that returns once the transport
    has seen the last of it end (an engine that cannot cancel a transfer but reports its end). The
    sender then keeps the blocks fenced until it returns, plus ``orphan_lifetime``, instead of trusting
    ``write_lifetime`` alone (a transfer that keeps making progress may outlive any fixed bound).
    """

    def __init__(self, message: str, *, may_land: bool | None = None,
                 settled: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(message)
        self.may_land = may_land
        self.settled = settled


class TransferError(AioembedError):
    """A transfer of a room did not complete.

    ``delivered``: for a streamed room (``receiver.stream()``), the token range ``(0, n)`` the
    stream had handed to the caller before this error (``None`` otherwise).
    """

    def __init__(self, message: str, *, room: RoomId | None = None) -> None:
        super().__init__(message)
        self.room = room
        self.delivered: tuple[int, int] | None = None


class TransferFailed(TransferError):
    """The transfer failed (peer error, transport error, invalid peer behaviour)."""


class TransferTimeout(TransferError, TimeoutError):
    """A phase of the transfer did not finish within its configured deadline."""

    def __init__(self, message: str, *, room: RoomId | None = None, phase: str) -> None:
        super().__init__(message, room=room)
        self.phase = phase


class TransferAborted(TransferError):
    """The transfer was cancelled by this side or by the peer."""


class IncompatiblePeer(TransferError):
    """The peer's layout, block size, transport or protocol version differs from ours."""


class PeerDead(TransferFailed):
    """The peer stopped answering heartbeats or went away while the room was active."""
