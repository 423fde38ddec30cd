"""The sender's view of its receivers: one :class:`PeerSession` per handshake session.

A receiver is known by its stable ``receiver_id``; each of its handshakes opens a session with a
new epoch, reached at a ZeroMQ identity. A newer session of the same receiver replaces the older
one at once: the old session gets no new write and no further frame, and its writes still in
flight are accounted for by the :class:`~aioembed.protocol.ownership.WriteLedger` until the
receiver is told they ended (``DRAINED``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aioembed.config import TransferConfig
from aioembed.layout import Layout
from aioembed.protocol.messages import Hello, RoomId
from aioembed.protocol.ownership import SessionKey
from aioembed.session.liveness import PeerClock
from aioembed.transports.base import Link

__all__ = ["PeerDirectory", "PeerSession", "handshake_problems"]


@dataclass(eq=False)
class PeerSession:
    """One receiver's handshake session."""

    identity: bytes
    key: SessionKey
    rank: int
    world: int
    num_blocks: int
    regions: tuple[tuple[int, int], ...]
    link: Link
    clock: PeerClock
    status_inline_bytes: int = 0
    """The most bytes of a round's rows the receiver takes inside its STATUS (``Hello.status_inline_bytes``)."""
    rooms: set[RoomId] = field(default_factory=set)
    alive: bool = True

    def __str__(self) -> str:
        return f"receiver rank {self.rank} ({self.key.receiver[:8]}, session {self.key.epoch})"


def handshake_problems(hello: Hello, layout: Layout, config: TransferConfig, transport: str) -> list[str]:
    """Why a receiver's HELLO cannot be served (empty if it can)."""
    problems = []
    if hello.fingerprint != layout.fingerprint:
        problems.append(f"layout fingerprint {hello.fingerprint} != sender's {layout.fingerprint} "
                        f"(sender layout {layout!r})")
    if hello.block_size != config.block_size:
        problems.append(f"block_size {hello.block_size} != sender's {config.block_size}")
    if hello.transport != transport:
        problems.append(f"transport {hello.transport!r} != sender's {transport!r}")
    if not 0 <= hello.rank < hello.world:
        problems.append(f"rank {hello.rank} outside world {hello.world} (ranks are 0..world-1)")
    if len(hello.regions) != len(layout):
        problems.append(f"{len(hello.regions)} pool regions for {len(layout)} layout fields")
    else:
        rows = hello.num_blocks * hello.block_size
        for (name, f), (_, length) in zip(layout.items(), hello.regions, strict=True):
            if length != rows * f.row_bytes:
                problems.append(f"pool region of field {name!r} is {length} bytes, expected {rows * f.row_bytes}")
    return problems


class PeerDirectory:
    """Live sessions, by ZeroMQ identity and by receiver id (one live session per receiver)."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, PeerSession] = {}
        self._by_receiver: dict[str, PeerSession] = {}

    def at(self, identity: bytes) -> PeerSession | None:
        """The live session reached at ``identity``."""
        return self._by_identity.get(identity)

    def of(self, receiver: str) -> PeerSession | None:
        """The live session of ``receiver``."""
        return self._by_receiver.get(receiver)

    def add(self, session: PeerSession) -> None:
        """Make ``session`` live (the caller ended the receiver's older session first)."""
        old = self._by_identity.get(session.identity)
        if old is not None and old is not session:
            self.remove(old)
        self._by_identity[session.identity] = session
        self._by_receiver[session.key.receiver] = session

    def move(self, session: PeerSession, identity: bytes) -> None:
        """The same session is now reached at another identity (the receiver's socket reconnected)."""
        if self._by_identity.get(session.identity) is session:
            del self._by_identity[session.identity]
        session.identity = identity
        self._by_identity[identity] = session

    def remove(self, session: PeerSession) -> None:
        """``session`` is no longer live."""
        if self._by_identity.get(session.identity) is session:
            del self._by_identity[session.identity]
        if self._by_receiver.get(session.key.receiver) is session:
            del self._by_receiver[session.key.receiver]

    def sessions(self) -> list[PeerSession]:
        """Every live session."""
        return list(self._by_identity.values())

    def __len__(self) -> int:
        return len(self._by_identity)
