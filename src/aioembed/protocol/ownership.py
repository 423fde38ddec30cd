"""Block ownership: who may still write a block, and when it may be freed. Sans-IO.

The one rule: **never free or re-announce a block that a write may still reach.** A silent
control plane proves nothing (an RDMA write keeps landing while heartbeats are lost, and a frozen
process resumes its writes when it thaws), so blocks are freed only on *proof* that the data
plane is quiet. Both sides keep a ledger here; the sessions feed events in and carry the returned
actions out, and never decide about blocks themselves.

Receiver: :class:`BlockLedger`. A *grant* is one reservation of pool blocks (one round of one
room). Its writer is ``(sender process id, session epoch)``: the sender that was given the
addresses, in the handshake session it was given them in.

=============  ==============================================================  =========  ======
state          event                                                           next       action
=============  ==============================================================  =========  ======
RESERVED       ``announce(writer)``: INIT / RESUME sent                        ANNOUNCED
RESERVED       ``release_unannounced``: no writer ever had the addresses       FREE       Free
ANNOUNCED      ``landed``: the writer's STATUS for this round                  READABLE
ANNOUNCED      ``split(n)``: the writer's PROGRESS: its writes into the first  ANNOUNCED  (new grant
               ``n`` blocks ended; they become a READABLE grant of their own              READABLE)
ANNOUNCED      ``ended(proof)``: final STATUS, ABORT_ACK, sender's ABORT,      FREE       Free
               REJECT of the reservation
ANNOUNCED      ``fence(reason)``: the room ended while the writer may write    FENCED     Fence
               (we aborted; STATUS(fence=True); its session was lost)
READABLE       ``consumed``: copied out, or the lease released                 FREE       Free
READABLE       ``trim(n)``: the round's rows fill its first ``n`` blocks; the  READABLE   Free (of
               rest, which no write reached, goes back                                    the rest)
FENCED         ``ended(proof)`` / ``landed``: a late answer from the writer    FREE       Free
FENCED         ``fence_released``: the writer's FENCE_RELEASE, after a settle  FREE       Free
               window of our own running time
FENCED         ``drained(sender, below)``: the same sender, in a later         FREE       Free
               session, confirms every write of epochs ``< below`` ended
FENCED         ``revoked(sender)``: the transport cut that writer off          FREE       Free
FENCED         ``writer_gone(sender)``: its process is known gone; freed       FREE       Free
               after the transport's write lifetime of our running time
=============  ==============================================================  =========  ======

An announced grant belongs to the room that announced it, and only that room moves it on, in the
order of its own inbox: a STATUS that arrived before a session loss is still valid data, and a
room busy copying a round does not have its next grant freed under it. Proofs about a whole
sender (``drained``, ``revoked``, ``writer_gone``) are remembered, and a grant fenced later by its
room is released by them at once (or after their window). They are remembered only while a grant of
that sender is live: such a proof covers the sessions it has had so far, and a room announces only in
the sender's current session, so no later grant needs it. Forgetting can only keep blocks fenced
longer, never free one early; and the ledger stays as large as its live grants, not as the number of
sender processes a receiver ever saw.

Timed releases count only time this process was running: a loop stall (a frozen process, a
long synchronous call) restarts their windows, because data that waited in a socket buffer
lands as soon as the process thaws.

Sender: :class:`WriteLedger`. Every write in flight per receiver session and room, and writes
that failed on a transport whose writes are not cancel-safe ("poisoned": they may land until
the transport's write lifetime has passed). It tells the sender when it may promise a receiver
that writes are over: ``FENCE_RELEASE`` for a room, ``DRAINED`` for earlier sessions.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeAlias

from aioembed.errors import AllocatorError
from aioembed.protocol.messages import RoomId

__all__ = [
    "BlockLedger",
    "DrainedSession",
    "Fence",
    "FenceReason",
    "Free",
    "Grant",
    "GrantState",
    "LedgerAction",
    "OwnershipError",
    "Proof",
    "ReleaseSource",
    "SendDrained",
    "SendFenceRelease",
    "SessionKey",
    "WriteLedger",
    "WriteOutcome",
    "WriterAction",
    "Writer",
]


class OwnershipError(AllocatorError):
    """An event that would break block ownership (a bug in the caller, never a peer's fault)."""


# -- receiver: the block ledger -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Writer:
    """Who may write a grant: a sender process, in one handshake session with this receiver."""

    sender: str
    """The sender process's id (``WELCOME.sender_id``)."""
    epoch: int
    """This receiver's session number with it."""
    address: str = field(default="", compare=False)
    """The sender's control address, for logs and metrics."""

    def __str__(self) -> str:
        return f"sender {self.address or '?'} ({self.sender[:8]}, session {self.epoch})"


class GrantState(enum.Enum):
    """Where a grant's blocks stand."""

    RESERVED = "reserved"
    """Taken from the allocator; no writer has the addresses."""
    ANNOUNCED = "announced"
    """A writer has the addresses and may be writing."""
    READABLE = "readable"
    """The writer said its write ended: the rows belong to the reader."""
    FENCED = "fenced"
    """A writer may still reach the blocks and how its write ended is unknown."""
    FREE = "free"
    """Back in the allocator (final)."""


_REACHABLE = frozenset({GrantState.ANNOUNCED, GrantState.FENCED})
"""Grant states a write of their writer may still reach."""


class Proof(enum.Enum):
    """Why no write can reach a grant any more."""

    STATUS = "the writer's STATUS"
    ABORT_ACK = "the writer's ABORT_ACK"
    SENDER_ABORT = "the writer's ABORT (sent once its writes ended)"
    FENCE_RELEASE = "the writer's FENCE_RELEASE"
    DRAINED = "the writer's DRAINED after a re-handshake"
    REVOKED = "the transport revoked the writer"
    WRITER_GONE = "the writer's process is gone and its transport's write lifetime has passed"
    CONSUMED = "the reader is done with the rows"
    UNANNOUNCED = "no writer ever had the addresses"


class FenceReason(enum.Enum):
    """Why a grant is fenced."""

    ABORT_UNACKED = "this side ended the room; waiting for the writer's ABORT_ACK"
    WRITE_FAILED = "the writer's write failed and may still land (its transport cannot cancel writes)"
    PEER_SILENT = "the writer stopped answering heartbeats; a write of it may still land"
    SESSION_DROPPED = "the writer dropped this session; a write of it may still land"
    WRITER_GONE = "the writer's process is gone; waiting out its transport's write lifetime"


@dataclass(eq=False, slots=True)
class Grant:
    """One reservation of pool blocks for one round of one room."""

    id: int
    room: RoomId
    blocks: tuple[int, ...]
    round: int = 0
    state: GrantState = GrantState.RESERVED
    writer: Writer | None = None
    reason: FenceReason | None = None
    release_at: float | None = None
    """When a timed release (FENCE_RELEASE settle, writer gone) frees it, if no proof comes first."""
    window: float = 0.0
    """Length of that window, to restart it after a loop stall."""
    timed_proof: Proof | None = None
    """The proof the timed release stands for."""
    proven: tuple[float, float, Proof] | None = None
    """(release at, window, proof) of the earliest timed release resting on the writer's own word, not on its
    being gone: what is left when :meth:`BlockLedger.writer_back` withdraws a ``WRITER_GONE`` release."""


@dataclass(frozen=True, slots=True)
class Free:
    """Give ``blocks`` back to the allocator."""

    grant: int
    room: RoomId
    blocks: tuple[int, ...]
    proof: Proof
    was: GrantState
    writer: Writer | None


@dataclass(frozen=True, slots=True)
class Fence:
    """Mark ``blocks`` fenced (still used; counted in ``stats.fenced``); log ``reason`` once."""

    grant: int
    room: RoomId
    blocks: tuple[int, ...]
    reason: FenceReason
    writer: Writer | None


LedgerAction: TypeAlias = Free | Fence

# state -> events allowed in it (the table above, as data: the hypothesis test reads it too)
TRANSITIONS: dict[GrantState, frozenset[str]] = {
    GrantState.RESERVED: frozenset({"announce", "release_unannounced"}),
    GrantState.ANNOUNCED: frozenset({"landed", "split", "ended", "fence"}),
    GrantState.READABLE: frozenset({"consumed", "trim"}),
    GrantState.FENCED: frozenset({"landed", "ended", "fence", "fence_released", "drained", "revoked",
                                  "writer_gone"}),
    GrantState.FREE: frozenset(),
}


class BlockLedger:
    """The receiver's block-ownership table: events in, :data:`LedgerAction` out.

    Pure bookkeeping (no clock of its own: callers pass ``now``); all methods are synchronous
    and meant for one event loop thread.
    """

    def __init__(self) -> None:
        self._grants: dict[int, Grant] = {}
        self._owner: dict[int, int] = {}  # block id -> live grant id
        self._ids = itertools.count(1)
        # What is known about whole senders, applied to grants fenced later:
        self._drained_below: dict[str, tuple[int, float]] = {}  # sender -> (epoch bound, settle)
        self._revoked_below: dict[str, int] = {}  # sender -> epochs below this were revoked
        self._gone: dict[str, float] = {}  # sender -> its write lifetime

    @staticmethod
    def _epoch(g: Grant) -> int:
        return g.writer.epoch if g.writer is not None else 0
    # -- queries -----------------------------------------------------------------------------

    def grant(self, grant_id: int) -> Grant:
        """The live grant ``grant_id`` (``OwnershipError`` if it was freed or never existed)."""
        g = self._grants.get(grant_id)
        if g is None:
            raise OwnershipError(f"grant {grant_id} is not live (already freed?)")
        return g

    def owner_of(self, block: int) -> Grant | None:
        """The live grant holding ``block``, if any."""
        gid = self._owner.get(block)
        return None if gid is None else self._grants[gid]

    def grants(self, *, state: GrantState | None = None, sender: str | None = None) -> list[Grant]:
        """Live grants, optionally filtered by state and writer process."""
        return [g for g in self._grants.values()
                if (state is None or g.state is state)
                and (sender is None or (g.writer is not None and g.writer.sender == sender))]

    def fenced_for(self, writer: Writer, room: RoomId) -> list[Grant]:
        """Grants of ``room`` that ``writer`` may still reach (announced or fenced)."""
        return [g for g in self._grants.values()
                if g.room == room and g.writer == writer and g.state in _REACHABLE]

    def reachable_by(self, sender: str) -> bool:
        """Whether a write of ``sender``'s process may still reach a live grant (announced or fenced). A readable
        grant (a lease) does not count: its writer said its writes ended."""
        return any(g.state in _REACHABLE and g.writer is not None and g.writer.sender == sender
                   for g in self._grants.values())

    def holds_room(self, writer: Writer, room: RoomId) -> bool:
        """True while a grant of ``room`` announced to ``writer`` is not yet proven quiet."""
        return bool(self.fenced_for(writer, room))

    def fenced_blocks(self) -> Counter[FenceReason]:
        """Fenced blocks by reason (for metrics and logs)."""
        out: Counter[FenceReason] = Counter()
        for g in self._grants.values():
            if g.state is GrantState.FENCED and g.reason is not None:
                out[g.reason] += len(g.blocks)
        return out

    def blocks_in(self, state: GrantState) -> int:
        """Blocks of live grants in ``state``."""
        return sum(len(g.blocks) for g in self._grants.values() if g.state is state)

    def __len__(self) -> int:
        return len(self._grants)

    # -- the grant's own life ------------------------------------------------------------------

    def reserve(self, room: RoomId, blocks: Iterable[int], *, round: int = 0) -> int:
        """Record blocks just taken from the allocator for ``room``; returns the grant id.

        Refuses a block still held by a live grant: that would re-announce a block a write may reach.
        """
        ids = tuple(blocks)
        if not ids:
            raise OwnershipError(f"room {room!r}: a grant needs at least one block")
        held = [b for b in ids if b in self._owner]
        if held or len(set(ids)) != len(ids):
            raise OwnershipError(f"room {room!r}: blocks {held[:4] or ids} are already held by live grants "
                                 f"{sorted({self._owner[b] for b in held})}")
        gid = next(self._ids)
        self._grants[gid] = Grant(gid, room, ids, round)
        for b in ids:
            self._owner[b] = gid
        return gid

    def announce(self, grant_id: int, writer: Writer) -> None:
        """The grant's addresses went to ``writer`` (INIT or RESUME)."""
        g = self._check(grant_id, "announce")
        g.state, g.writer = GrantState.ANNOUNCED, writer

    def release_unannounced(self, grant_id: int) -> list[LedgerAction]:
        """A reservation no writer ever saw goes back."""
        g = self._check(grant_id, "release_unannounced")
        return [self._free(g, Proof.UNANNOUNCED)]

    def landed(self, grant_id: int) -> list[LedgerAction]:
        """The writer's STATUS for this grant's round: its write ended, the rows are in."""
        g = self._check(grant_id, "landed")
        if g.state is GrantState.FENCED:
            return [self._free(g, Proof.STATUS)]  # nobody reads a fenced grant: its room already ended
        g.state, g.release_at = GrantState.READABLE, None
        return []

    def split(self, grant_id: int, blocks: int) -> int:
        """The writer's PROGRESS: its writes into the first ``blocks`` blocks of an announced grant ended
        and it will not write them again in this round. They become a READABLE grant of their own (its
        id is returned), so a reader may hold them while the rest of the round is still written; the rest
        stays ANNOUNCED under ``grant_id``."""
        g = self._check(grant_id, "split")
        if not 0 < blocks < len(g.blocks):
            raise OwnershipError(f"grant {grant_id} of room {g.room!r}: cannot split {blocks} of its "
                                 f"{len(g.blocks)} blocks (at least one must stay announced)")
        head, g.blocks = g.blocks[:blocks], g.blocks[blocks:]
        gid = next(self._ids)
        self._grants[gid] = Grant(gid, g.room, head, g.round, GrantState.READABLE, g.writer)
        for b in head:
            self._owner[b] = gid
        return gid

    def trim(self, grant_id: int, blocks: int) -> list[LedgerAction]:
        """A readable grant keeps its first ``blocks`` blocks, which hold its round's rows; the rest goes
        back now. A reservation is made before the request's length is known (``default_tokens``), and a
        zero-copy reader holds its rows until the caller releases them: it must not hold the rest too. The
        round's STATUS made the grant readable, so every write into any of its blocks has ended."""
        g = self._check(grant_id, "trim")  # readable only: its writes ended
        if not 0 < blocks <= len(g.blocks):
            raise OwnershipError(f"grant {grant_id} of room {g.room!r}: cannot keep {blocks} of its "
                                 f"{len(g.blocks)} blocks")
        if blocks == len(g.blocks):
            return []
        rest, g.blocks = g.blocks[blocks:], g.blocks[:blocks]
        gid = next(self._ids)
        tail = Grant(gid, g.room, rest, g.round, GrantState.READABLE, g.writer)
        self._grants[gid] = tail
        for b in rest:
            self._owner[b] = gid
        return [self._free(tail, Proof.CONSUMED)]

    def consumed(self, grant_id: int) -> list[LedgerAction]:
        """The reader is done with a readable grant (copied out, lease released, or room failed)."""
        g = self._check(grant_id, "consumed")
        return [self._free(g, Proof.CONSUMED)]

    def ended(self, grant_id: int, proof: Proof) -> list[LedgerAction]:
        """The writer proved its writes into the grant are over (final STATUS, ABORT_ACK, ...)."""
        if proof not in (Proof.STATUS, Proof.ABORT_ACK, Proof.SENDER_ABORT):
            raise OwnershipError(f"grant {grant_id}: {proof.name} is not a writer's answer")
        g = self._check(grant_id, "ended")
        return [self._free(g, proof)]

    def fence(self, grant_id: int, reason: FenceReason, *, now: float = 0.0) -> list[LedgerAction]:
        """The grant's room ended while its writer may still write (or its write failed uncertainly).

        What is already known about its sender (drained, revoked, gone) applies at once."""
        g = self._check(grant_id, "fence")
        return self._fence(g, reason) + self._known_proofs(g, now)

    def _known_proofs(self, g: Grant, now: float) -> list[LedgerAction]:
        w = g.writer
        if w is None or g.state is not GrantState.FENCED:
            return []
        if w.epoch < self._revoked_below.get(w.sender, 0):
            return [self._free(g, Proof.REVOKED)]
        drained = self._drained_below.get(w.sender)
        if drained is not None and w.epoch < drained[0]:
            self._timed(g, Proof.DRAINED, now, drained[1])
        lifetime = self._gone.get(w.sender)
        if lifetime is not None:
            self._timed(g, Proof.WRITER_GONE, now, lifetime)
        return self.tick(now) if g.release_at is not None and g.release_at <= now else []

    # -- proofs and doubts about a writer ------------------------------------------------------

    def late_answer(self, writer: Writer, room: RoomId, proof: Proof, *, round: int | None = None,
                    now: float = 0.0, settle: float = 0.0) -> list[LedgerAction]:
        """A writer's answer for a room no longer in flight here: frees what it proves quiet
        (only the grant of ``round`` when the answer is about one round's data). A grant whose write
        failed and may land (``WRITE_FAILED``) is freed ``settle`` seconds later, as on FENCE_RELEASE:
        the writer answers once that write can no longer be sent, and bytes it sent may still be in our
        socket buffers."""
        out: list[LedgerAction] = []
        for g in self.fenced_for(writer, room):
            if round is not None and g.round != round:
                continue
            if settle > 0 and g.state is GrantState.FENCED and g.reason is FenceReason.WRITE_FAILED:
                self._timed(g, proof, now, settle)
            else:
                out.extend(self.ended(g.id, proof))
        return out

    def fence_released(self, writer: Writer, room: RoomId, *, now: float, settle: float) -> list[LedgerAction]:
        """The writer's FENCE_RELEASE: its failed write can no longer be sent. Freed after ``settle``
        seconds of our running time (bytes already in our socket buffers land meanwhile)."""
        for g in self.fenced_for(writer, room):
            if g.state is GrantState.FENCED:  # an announced grant needs its STATUS first: ignored
                self._timed(g, Proof.FENCE_RELEASE, now, settle)
        return self.tick(now)

    def drained(self, sender: str, below_epoch: int, *, now: float, settle: float = 0.0) -> list[LedgerAction]:
        """``sender`` confirmed that no write of its sessions numbered below ``below_epoch`` is in
        flight: its fenced grants of those sessions are freed after ``settle`` seconds of our
        running time (0: at once), and so are those its rooms fence later."""
        old = self._drained_below.get(sender)
        if old is None or below_epoch > old[0]:
            self._drained_below[sender] = (below_epoch, settle)
        for g in self._fenced_of(sender):
            if self._epoch(g) < below_epoch:
                self._timed(g, Proof.DRAINED, now, settle)
        actions = self.tick(now)
        self._forget_if_idle(sender)
        return actions

    def revoked(self, sender: str, *, below_epoch: int) -> list[LedgerAction]:
        """The transport guarantees that no write ``sender`` posted so far (in its sessions numbered
        below ``below_epoch``) can land any more: its fenced grants of those sessions are freed."""
        self._revoked_below[sender] = max(below_epoch, self._revoked_below.get(sender, 0))
        actions: list[LedgerAction] = [self._free(g, Proof.REVOKED) for g in self._fenced_of(sender)
                                       if self._epoch(g) < below_epoch]
        self._forget_if_idle(sender)
        return actions

    def writer_gone(self, sender: str, *, now: float, lifetime: float) -> list[LedgerAction]:
        """``sender``'s process is known gone: what it may still write is freed after ``lifetime``
        seconds of our running time (the transport's declared write lifetime)."""
        self._gone[sender] = lifetime
        for g in self._fenced_of(sender):
            self._timed(g, Proof.WRITER_GONE, now, lifetime)
        actions = self.tick(now)
        self._forget_if_idle(sender)
        return actions

    def writer_back(self, sender: str) -> None:
        """``sender`` answered again after we thought its process gone: that was wrong, so the
        releases that rested on it are withdrawn (its grants stay fenced until it proves them quiet; one its own
        proof scheduled, a settle after DRAINED, FENCE_RELEASE or a late answer, stands)."""
        self._gone.pop(sender, None)
        for g in self.grants(sender=sender):
            if g.timed_proof is Proof.WRITER_GONE:
                g.release_at, g.window, g.timed_proof = g.proven if g.proven is not None else (None, 0.0, None)

    # -- time --------------------------------------------------------------------------------

    def loop_stalled(self, now: float) -> None:
        """Our loop did not run for a while: restart every timed release window from ``now``."""
        for g in self._grants.values():
            if g.release_at is not None:
                g.release_at = max(g.release_at, now + g.window)
            if g.proven is not None:
                at, window, proof = g.proven
                g.proven = (max(at, now + window), window, proof)

    def next_deadline(self) -> float | None:
        """The earliest timed release, if any."""
        times = [g.release_at for g in self._grants.values() if g.release_at is not None]
        return min(times) if times else None

    def tick(self, now: float) -> list[LedgerAction]:
        """Free the grants whose timed release has come."""
        out: list[LedgerAction] = []
        for g in list(self._grants.values()):
            if g.release_at is not None and g.release_at <= now:
                out.append(self._free(g, g.timed_proof or Proof.WRITER_GONE))
        return out

    # -- internals -----------------------------------------------------------------------------

    def _check(self, grant_id: int, event: str) -> Grant:
        g = self.grant(grant_id)
        if event not in TRANSITIONS[g.state]:
            raise OwnershipError(f"grant {grant_id} of room {g.room!r}: {event} is illegal in state {g.state.name}")
        return g

    def _fenced_of(self, sender: str) -> list[Grant]:
        return [g for g in self._grants.values()
                if g.state is GrantState.FENCED and g.writer is not None and g.writer.sender == sender]

    def _fence(self, g: Grant, reason: FenceReason) -> list[LedgerAction]:
        if g.state is GrantState.FENCED:
            if g.reason is not FenceReason.WRITE_FAILED:
                g.reason = reason  # keep the most telling reason; the blocks are fenced already
            return []
        g.state, g.reason = GrantState.FENCED, reason
        return [Fence(g.id, g.room, g.blocks, reason, g.writer)]

    @staticmethod
    def _timed(g: Grant, proof: Proof, now: float, window: float) -> None:
        """Free ``g`` at ``now + window`` unless an earlier proof frees it first."""
        at = now + window
        if g.release_at is None or at < g.release_at:
            g.release_at, g.window, g.timed_proof = at, window, proof
        if proof is not Proof.WRITER_GONE and (g.proven is None or at < g.proven[0]):
            g.proven = (at, window, proof)

    def _free(self, g: Grant, proof: Proof) -> Free:
        was = g.state
        g.state = GrantState.FREE
        del self._grants[g.id]
        for b in g.blocks:
            del self._owner[b]
        if g.writer is not None:
            self._forget_if_idle(g.writer.sender)
        return Free(g.id, g.room, g.blocks, proof, was, g.writer)

    def _forget_if_idle(self, sender: str) -> None:
        """Drop the proofs remembered about ``sender`` once none of its grants is live (see the module
        docstring: no later grant can need them)."""
        if sender not in self._drained_below and sender not in self._revoked_below and sender not in self._gone:
            return
        if self.grants(sender=sender):
            return
        self._drained_below.pop(sender, None)
        self._revoked_below.pop(sender, None)
        self._gone.pop(sender, None)


# -- sender: the write ledger ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionKey:
    """One handshake session of one receiver."""

    receiver: str
    """The receiver's stable id (``HELLO.receiver_id``)."""
    epoch: int


class WriteOutcome(enum.Enum):
    """How a write ended, as far as the sender can tell."""

    LANDED = "landed"
    """It returned: every byte is visible at the destination."""
    FAILED_CLEANLY = "failed"
    """It failed, and its transport guarantees that a failed write never lands later."""
    POISONED = "poisoned"
    """It failed on a transport whose failed writes may still land: may reach the destination
    (and read the source) until the transport's write lifetime has passed."""


@dataclass(frozen=True, slots=True)
class SendFenceRelease:
    """Tell ``session`` that the poisoned write into ``room`` can no longer land."""

    session: SessionKey
    room: RoomId


@dataclass(frozen=True, slots=True)
class SendDrained:
    """Tell ``session`` (the receiver's current one) that no write of its earlier sessions is in flight."""

    session: SessionKey
    below_epoch: int


@dataclass(frozen=True, slots=True)
class ReleaseSource:
    """No write reads the source of send attempt ``source`` any more: let it go (unregister, unstage or drop it)."""

    source: int


@dataclass(frozen=True, slots=True)
class DrainedSession:
    """For logs: the last write into a closed session ended."""

    session: SessionKey


WriterAction: TypeAlias = SendFenceRelease | SendDrained | ReleaseSource | DrainedSession


@dataclass(eq=False, slots=True)
class _Write:
    id: int
    session: SessionKey
    room: RoomId
    source: int
    expires: float | None = None  # poisoned: may land until then (inf: until the transport says it settled)
    lifetime_ends: float = 0.0  # poisoned: when its transport's write lifetime ends (a floor when settling)


class WriteLedger:
    """The sender's account of writes in flight, per receiver session and room.

    A write counts as in flight from ``started`` until it landed or failed cleanly, or, when it
    was poisoned, until the transport's write lifetime has passed. Only then may the sender tell
    the receiver that the blocks are quiet.
    """

    def __init__(self) -> None:
        self._writes: dict[int, _Write] = {}
        self._ids = itertools.count(1)
        self._open: dict[str, int] = {}  # receiver -> epoch of its open session
        self._closed: set[SessionKey] = set()  # closed sessions with writes still in flight
        self._sources: dict[int, bool] = {}  # source -> send() still running
        self._source_ids = itertools.count(1)
        self._fence_told: set[tuple[SessionKey, RoomId]] = set()  # STATUS(fence=True) went out

    # -- queries -----------------------------------------------------------------------------

    def in_flight(self, session: SessionKey, room: RoomId) -> bool:
        """True while a write of ``room`` into ``session`` may still land (poisoned ones included)."""
        return any(w.session == session and w.room == room for w in self._writes.values())

    def writes_to(self, receiver: str, *, below_epoch: int | None = None) -> int:
        """Writes in flight to ``receiver`` (only sessions numbered below ``below_epoch`` if given)."""
        return sum(1 for w in self._writes.values() if w.session.receiver == receiver
                   and (below_epoch is None or w.session.epoch < below_epoch))

    def writes_into(self, session: SessionKey) -> int:
        """Writes into ``session`` not yet known to be over."""
        return sum(1 for w in self._writes.values() if w.session == session)

    def is_open(self, session: SessionKey) -> bool:
        """True while ``session`` is the receiver's live session."""
        return self._open.get(session.receiver) == session.epoch

    def __len__(self) -> int:
        return len(self._writes)

    # -- sources -----------------------------------------------------------------------------

    def new_source(self) -> int:
        """A ``send()`` has its source (tensors registered, staged, or read where they lie): returns the id its
        writes refer to."""
        sid = next(self._source_ids)
        self._sources[sid] = True
        return sid

    def source_done(self, source: int) -> list[WriterAction]:
        """``send()`` returned: the source is released once no write reads it."""
        if source not in self._sources:
            raise OwnershipError(f"source {source} is unknown or already released")
        self._sources[source] = False
        return self._release_source(source)

    # -- sessions ----------------------------------------------------------------------------

    def session_opened(self, session: SessionKey) -> list[WriterAction]:
        """A handshake with ``session`` succeeded (closing the receiver's earlier session, if open)."""
        out: list[WriterAction] = []
        old = self._open.get(session.receiver)
        if old is not None and old != session.epoch:
            out.extend(self.session_closed(SessionKey(session.receiver, old)))
        self._open[session.receiver] = session.epoch
        if self.writes_to(session.receiver, below_epoch=session.epoch) == 0:
            out.append(SendDrained(session, session.epoch))
        return out

    def session_closed(self, session: SessionKey) -> list[WriterAction]:
        """The session ended (its receiver is silent, gone or started another): no new write goes to it."""
        if self._open.get(session.receiver) == session.epoch:
            del self._open[session.receiver]
        self._fence_told = {(s, r) for s, r in self._fence_told if s != session}  # DRAINED covers them
        if any(w.session == session for w in self._writes.values()):
            self._closed.add(session)
        return []

    def fence_told(self, session: SessionKey, room: RoomId) -> list[WriterAction]:
        """``STATUS(fence=True)`` for ``room`` went to ``session``: it is owed a ``FENCE_RELEASE``
        once no write of the room can land, never before that STATUS (the receiver would ignore it)."""
        if self.in_flight(session, room):
            self._fence_told.add((session, room))
            return []
        return [SendFenceRelease(session, room)] if self.is_open(session) else []

    # -- writes ------------------------------------------------------------------------------

    def started(self, session: SessionKey, room: RoomId, source: int) -> int:
        """A write of ``room`` from ``source`` into ``session`` is being posted; returns its id."""
        if not self.is_open(session):
            raise OwnershipError(f"room {room!r}: no write may start into closed session {session}")
        if not self._sources.get(source, False):
            raise OwnershipError(f"room {room!r}: source {source} is not held by a running send()")
        wid = next(self._ids)
        self._writes[wid] = _Write(wid, session, room, source)
        return wid

    def ended(self, write_id: int, outcome: WriteOutcome, *, now: float, lifetime: float,
              settling: bool = False) -> list[WriterAction]:
        """The write returned or raised; ``lifetime`` is its transport's write lifetime. ``settling``
        (poisoned only): the transport will say when the write's last transfer ended (:meth:`settled`);
        until then it may land, however long that takes."""
        w = self._writes.get(write_id)
        if w is None or w.expires is not None:
            raise OwnershipError(f"write {write_id} is not in flight")
        if outcome is WriteOutcome.POISONED:
            w.lifetime_ends = now + lifetime
            w.expires = math.inf if settling else w.lifetime_ends
            return self.tick(now)
        if settling:
            raise OwnershipError(f"write {write_id}: only a poisoned write settles later")
        return self._retire(w)

    def settled(self, write_id: int, *, now: float, margin: float) -> list[WriterAction]:
        """The transport saw the last transfer of settling write ``write_id`` end: what it had sent may
        still land for ``margin`` (bytes in the peer's buffers), and never before its write lifetime."""
        w = self._writes.get(write_id)
        if w is None or w.expires != math.inf:
            raise OwnershipError(f"write {write_id} is not waiting to settle")
        w.expires = max(w.lifetime_ends, now + margin)
        return self.tick(now)

    def tick(self, now: float) -> list[WriterAction]:
        """Retire poisoned writes whose lifetime has passed."""
        out: list[WriterAction] = []
        for w in list(self._writes.values()):
            if w.expires is not None and w.expires <= now:
                out.extend(self._retire(w))
        return out

    def loop_stalled(self, now: float, lifetime: float) -> None:
        """Our loop (and our transport's engine with it, in a frozen process) did not run: a poisoned
        write may move on when we thaw, so its lifetime starts again."""
        for w in self._writes.values():
            if w.expires is not None:
                w.lifetime_ends = max(w.lifetime_ends, now + lifetime)
                w.expires = max(w.expires, now + lifetime)

    def next_deadline(self) -> float | None:
        """When the next poisoned write expires, if any."""
        times = [w.expires for w in self._writes.values() if w.expires is not None and w.expires != math.inf]
        return min(times) if times else None

    # -- internals -----------------------------------------------------------------------------

    def _retire(self, w: _Write) -> list[WriterAction]:
        del self._writes[w.id]
        out: list[WriterAction] = []
        session = w.session
        told = (session, w.room) in self._fence_told
        # Owed once the room's last write ended, however it ended: the fence may have been told while a write
        # that then landed or failed cleanly was still going (an answer about a room that ended meanwhile).
        if told and not self.in_flight(session, w.room):
            self._fence_told.discard((session, w.room))
            if self.is_open(session):
                out.append(SendFenceRelease(session, w.room))
        if session in self._closed and not any(x.session == session for x in self._writes.values()):
            self._closed.discard(session)
            out.append(DrainedSession(session))
        current = self._open.get(session.receiver)
        if current is not None and session.epoch < current and self.writes_to(
                session.receiver, below_epoch=current) == 0:
            out.append(SendDrained(SessionKey(session.receiver, current), current))
        out.extend(self._release_source(w.source))
        return out

    def _release_source(self, source: int) -> list[WriterAction]:
        if self._sources.get(source, True):
            return []  # unknown (released already) or send() still running
        if any(w.source == source for w in self._writes.values()):
            return []
        del self._sources[source]
        return [ReleaseSource(source)]
