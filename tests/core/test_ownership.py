"""Block ownership, sans-IO: the ledgers never free (or let a sender promise) what a write may reach.

The stateful tests run random interleavings of every event kind against a model of the data plane:
the model knows which writes are in flight and which blocks they target, and the senders in it are
truthful (a proof is given only when it holds). The invariant: a block the ledger frees has no
write that may still reach it, so it can never be re-announced while one does. A failed write that
settled at its sender is such a write until ``SETTLE`` has passed (its last bytes may still sit in the
receiver's socket buffers), so the settle on FENCE_RELEASE, DRAINED and late answers is checked too.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from aioembed.protocol.ownership import (
    TRANSITIONS,
    BlockLedger,
    DrainedSession,
    Fence,
    FenceReason,
    Free,
    GrantState,
    OwnershipError,
    Proof,
    ReleaseSource,
    SendDrained,
    SendFenceRelease,
    SessionKey,
    WriteLedger,
    WriteOutcome,
    Writer,
)

STATEFUL = settings(max_examples=150, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# -- the receiver's block ledger --------------------------------------------------------------


@dataclass(eq=False)
class _Write:
    """A write posted by a sender process into one grant's blocks (the model's data plane)."""

    id: int
    sender: str
    epoch: int
    grant: int
    blocks: tuple[int, ...]
    poisoned: bool = False
    deadline: float | None = None  # it lands by then at the latest (a gone writer's, or one that settled)
    settled: bool = False
    """Poisoned, and its sender saw its last transfer end: nothing more is sent, but bytes already sent may
    still sit in the receiver's socket buffers and land within ``SETTLE`` (its ``deadline``)."""


@dataclass(eq=False)
class _Sender:
    process: str
    epoch: int = 1
    gone_at: float | None = None


@dataclass(eq=False)
class _GrantModel:
    id: int
    room: str
    blocks: tuple[int, ...]
    writer: Writer | None = None
    written: bool = False  # a write was posted into it (once per grant, like one round)
    room_open: bool = True  # the room still reads it
    chunk: int = 0  # a write into the first ``chunk`` blocks was posted (a PROGRESS is due once it lands)


NUM_BLOCKS = 12
LIFETIME = 2.0
SETTLE = 0.25


class BlockLedgerMachine(RuleBasedStateMachine):
    """Random interleavings of reservations, announcements, writes, proofs and doubts."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = BlockLedger()
        self.free: set[int] = set(range(NUM_BLOCKS))
        self.fenced: set[int] = set()
        self.now = 0.0
        self.grants: dict[int, _GrantModel] = {}
        self.writes: dict[int, _Write] = {}
        self.ids = itertools.count(1)
        self.rooms = itertools.count(1)
        self.senders = {name: _Sender(f"{name}-p1") for name in ("a", "b")}

    # -- helpers ---------------------------------------------------------------------------

    def apply(self, actions: list[Free | Fence]) -> None:
        for a in actions:
            if isinstance(a, Fence):
                assert set(a.blocks) <= set(range(NUM_BLOCKS)) and not set(a.blocks) & self.free
                self.fenced |= set(a.blocks)
                continue
            reach = [w for w in self.writes.values() if set(w.blocks) & set(a.blocks)]
            assert not reach, f"freed blocks {a.blocks} ({a.proof.name}) while writes {reach} may reach them"
            assert not set(a.blocks) & self.free, "double free"
            self.free |= set(a.blocks)
            self.fenced -= set(a.blocks)
            self.grants.pop(a.grant, None)

    def live(self, *states: GrantState) -> list[_GrantModel]:
        out = []
        for g in self.grants.values():
            try:
                state = self.ledger.grant(g.id).state
            except OwnershipError:
                continue
            if not states or state in states:
                out.append(g)
        return out

    def writer_of(self, name: str) -> Writer:
        s = self.senders[name]
        return Writer(s.process, s.epoch, f"tcp://{name}")

    # -- rules -----------------------------------------------------------------------------

    @rule(k=st.integers(1, 3))
    def reserve(self, k: int) -> None:
        self._reserve(k)

    def _reserve(self, k: int) -> _GrantModel | None:
        if len(self.free) < k:
            return None
        blocks = tuple(sorted(self.free)[:k])
        self.free -= set(blocks)
        room = f"r{next(self.rooms)}"
        gid = self.ledger.reserve(room, blocks)
        g = self.grants[gid] = _GrantModel(gid, room, blocks)
        return g

    @rule(data=st.data(), sender=st.sampled_from(["a", "b"]))
    def announce(self, data: st.DataObject, sender: str) -> None:
        grants = self.live(GrantState.RESERVED)
        if grants:
            g = data.draw(st.sampled_from(grants))
            g.writer = self.writer_of(sender)
            self.ledger.announce(g.id, g.writer)

    @rule(data=st.data())
    def release_unannounced(self, data: st.DataObject) -> None:
        grants = self.live(GrantState.RESERVED)
        if grants:
            self.apply(self.ledger.release_unannounced(data.draw(st.sampled_from(grants)).id))

    @rule(data=st.data())
    def sender_writes(self, data: st.DataObject) -> None:
        """A live sender posts the write of a grant announced to it in its current session."""
        grants = [g for g in self.live(GrantState.ANNOUNCED, GrantState.FENCED)
                  if g.writer is not None and not g.written and self._current(g.writer)]
        if not grants:
            return
        g = data.draw(st.sampled_from(grants))
        assert g.writer is not None
        g.written = True
        wid = next(self.ids)
        self.writes[wid] = _Write(wid, g.writer.sender, g.writer.epoch, g.id, g.blocks)

    @rule(data=st.data())
    def sender_writes_a_chunk(self, data: st.DataObject) -> None:
        """A streaming room: the writer posts the first blocks of the round on their own."""
        grants = [g for g in self.live(GrantState.ANNOUNCED) if g.writer is not None and not g.written
                  and not g.chunk and len(g.blocks) > 1 and self._current(g.writer)]
        if not grants:
            return
        g = data.draw(st.sampled_from(grants))
        assert g.writer is not None
        g.chunk = data.draw(st.integers(1, len(g.blocks) - 1))
        wid = next(self.ids)
        self.writes[wid] = _Write(wid, g.writer.sender, g.writer.epoch, g.id, g.blocks[:g.chunk])

    @rule(data=st.data())
    def progress_splits(self, data: st.DataObject) -> None:
        """The writer's PROGRESS, sent once the chunk's write landed: those blocks become readable."""
        grants = [g for g in self.live(GrantState.ANNOUNCED) if g.chunk and g.room_open
                  and not any(set(w.blocks) & set(g.blocks[:g.chunk]) for w in self.writes.values())]
        if not grants:
            return
        g = data.draw(st.sampled_from(grants))
        head = self.ledger.split(g.id, g.chunk)
        assert self.ledger.grant(head).state is GrantState.READABLE
        assert self.ledger.grant(head).blocks == g.blocks[:g.chunk]
        self.grants[head] = _GrantModel(head, g.room, g.blocks[:g.chunk], g.writer, written=True)
        g.blocks, g.chunk = g.blocks[g.chunk:], 0

    def _current(self, writer: Writer) -> bool:
        """Is ``writer`` a live process in its current session (the only place it posts new writes)?"""
        return any(s.process == writer.sender and s.epoch == writer.epoch for s in self.senders.values())

    @rule(data=st.data())
    def write_lands(self, data: st.DataObject) -> None:
        landing = sorted(w.id for w in self.writes.values() if not w.settled)  # settled: lands by its deadline
        if landing:
            self.writes.pop(data.draw(st.sampled_from(landing)))

    @rule(data=st.data())
    def write_fails_but_may_land(self, data: st.DataObject) -> None:
        """A non-cancel-safe failure: the write stays in flight (poisoned)."""
        live = [w for w in self.writes.values() if not w.poisoned]
        if live:
            data.draw(st.sampled_from(live)).poisoned = True

    def _writes_into(self, g: _GrantModel) -> list[_Write]:
        return [w for w in self.writes.values() if w.grant == g.id]

    @rule(data=st.data())
    def status_after_landing(self, data: st.DataObject) -> None:
        """The writer's STATUS for a round whose write landed (sent only then)."""
        grants = [g for g in self.live(GrantState.ANNOUNCED, GrantState.FENCED)
                  if g.written and not self._writes_into(g)]
        if not grants:
            return
        g = data.draw(st.sampled_from(grants))
        if self.ledger.grant(g.id).state is GrantState.ANNOUNCED and g.room_open:
            self.apply(self.ledger.landed(g.id))
        else:
            assert g.writer is not None
            self.apply(self.ledger.late_answer(g.writer, g.room, Proof.STATUS))

    @rule(data=st.data(), sender=st.sampled_from(["a", "b"]))
    def write_fails_and_its_room_fences(self, data: st.DataObject, sender: str) -> None:
        """The usual path of a failed write, in one step (a new room's if no write is in flight): it may still
        land (poisoned), its sender says ``STATUS(FAILED, fence=True)``, the receiver fences the round's grant."""
        announced = self.live(GrantState.ANNOUNCED)
        live = [w for w in self.writes.values() if not w.poisoned and self.grants.get(w.grant) in announced]
        if not live:
            fresh = self._reserve(1)
            if fresh is None:
                return
            fresh.writer, fresh.written = self.writer_of(sender), True
            self.ledger.announce(fresh.id, fresh.writer)
            wid = next(self.ids)
            self.writes[wid] = _Write(wid, fresh.writer.sender, fresh.writer.epoch, fresh.id, fresh.blocks)
            live = [self.writes[wid]]
        w = data.draw(st.sampled_from(live))
        w.poisoned = True
        g = self.grants[w.grant]
        g.room_open = False
        self.apply(self.ledger.fence(g.id, FenceReason.WRITE_FAILED, now=self.now))

    @rule(data=st.data())
    def failed_write_settles_at_its_sender(self, data: st.DataObject) -> None:
        """The sender's transport says a poisoned write ended; what it sent lands within ``SETTLE``."""
        live = [w for w in self.writes.values() if w.poisoned and not w.settled]
        if live:
            w = data.draw(st.sampled_from(live))
            w.settled = True
            w.deadline = min(w.deadline if w.deadline is not None else math.inf, self.now + SETTLE)

    @staticmethod
    def _settled(writes: list[_Write]) -> bool:
        """Has the sender seen every one of ``writes`` end (so that it may vouch for them after a settle)?"""
        return all(w.settled for w in writes)

    @rule(data=st.data(), proof=st.sampled_from([Proof.STATUS, Proof.ABORT_ACK, Proof.SENDER_ABORT]))
    def late_answer_after_a_failed_write(self, data: st.DataObject, proof: Proof) -> None:
        """The writer's final STATUS / ABORT_ACK / ABORT for a room whose write failed and was fenced: sent once
        that write settled at the sender, while its last bytes may still be on their way."""
        grants = [g for g in self.live(GrantState.FENCED)
                  if self.ledger.grant(g.id).reason is FenceReason.WRITE_FAILED and g.writer is not None
                  and self._settled(self._writes_into(g))]
        if grants:
            g = data.draw(st.sampled_from(grants))
            assert g.writer is not None
            g.written = True  # the room is over for the sender
            self.apply(self.ledger.late_answer(g.writer, g.room, proof, now=self.now, settle=SETTLE))

    @rule(data=st.data(), proof=st.sampled_from([Proof.STATUS, Proof.ABORT_ACK, Proof.SENDER_ABORT]))
    def writer_says_over(self, data: st.DataObject, proof: Proof) -> None:
        """A final non-fence STATUS / ABORT_ACK / ABORT: sent only once no write is in flight."""
        grants = [g for g in self.live(GrantState.ANNOUNCED, GrantState.FENCED) if not self._writes_into(g)]
        if grants:
            g = data.draw(st.sampled_from(grants))
            g.written = True  # the room (or this round) is over for the sender
            self.apply(self.ledger.ended(g.id, proof))

    @rule(data=st.data(), reason=st.sampled_from(list(FenceReason)))
    def room_fails_while_announced(self, data: st.DataObject, reason: FenceReason) -> None:
        """A room ends while its writer may write (abort, fence STATUS, or it processes a session loss)."""
        grants = self.live(GrantState.ANNOUNCED)
        if grants:
            g = data.draw(st.sampled_from(grants))
            g.room_open = False
            self.apply(self.ledger.fence(g.id, reason, now=self.now))

    @rule(data=st.data())
    def fence_release(self, data: st.DataObject) -> None:
        """FENCE_RELEASE: only once the grant's writes can no longer be sent (they settled at the sender; their
        last bytes may land within ``SETTLE``)."""
        grants = [g for g in self.live(GrantState.FENCED) if self._settled(self._writes_into(g))]
        if grants:
            g = data.draw(st.sampled_from(grants))
            assert g.writer is not None
            g.written = True  # the room is over for the sender: it never writes it again
            self.apply(self.ledger.fence_released(g.writer, g.room, now=self.now, settle=SETTLE))

    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        """A zero-copy reader keeps only the blocks its round's rows fill; the rest goes back now."""
        grants = self.live(GrantState.READABLE)
        if grants:
            g = data.draw(st.sampled_from(grants))
            keep = data.draw(st.integers(1, len(g.blocks)))
            self.apply(self.ledger.trim(g.id, keep))
            g.blocks = g.blocks[:keep]
            assert self.ledger.grant(g.id).blocks == g.blocks

    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        grants = self.live(GrantState.READABLE)
        if grants:
            self.apply(self.ledger.consumed(data.draw(st.sampled_from(grants)).id))

    def _rooms_see_the_loss(self, writer: Writer, reason: FenceReason, data: st.DataObject) -> None:
        """Some of the writer's rooms process the loss now (fencing their grants), others later."""
        for g in self.live(GrantState.ANNOUNCED):
            if g.writer == writer and data.draw(st.booleans()):
                g.room_open = False
                self.apply(self.ledger.fence(g.id, reason, now=self.now))

    @rule(sender=st.sampled_from(["a", "b"]), data=st.data())
    def peer_silent(self, sender: str, data: st.DataObject) -> None:
        """Heartbeats stop: rooms fail and fence (never free); we shake hands again."""
        self._rooms_see_the_loss(self.writer_of(sender), FenceReason.PEER_SILENT, data)
        self.senders[sender].epoch += 1

    @rule(sender=st.sampled_from(["a", "b"]), data=st.data())
    def session_dropped_and_rehandshake(self, sender: str, data: st.DataObject) -> None:
        self._rooms_see_the_loss(self.writer_of(sender), FenceReason.SESSION_DROPPED, data)
        self.senders[sender].epoch += 1

    @rule(sender=st.sampled_from(["a", "b"]))
    def drained(self, sender: str) -> None:
        """The same sender, in its current session, confirms earlier sessions drained (only if true: their
        writes all ended at the sender; the last bytes of failed ones may land within ``SETTLE``)."""
        s = self.senders[sender]
        if s.gone_at is not None:
            return
        if not self._settled([w for w in self.writes.values() if w.sender == s.process and w.epoch < s.epoch]):
            return
        self.apply(self.ledger.drained(s.process, s.epoch, now=self.now, settle=SETTLE))

    @rule(sender=st.sampled_from(["a", "b"]))
    def sender_restarts(self, sender: str) -> None:
        """A new process answers at the address: the old one is gone; its writes land within LIFETIME."""
        s = self.senders[sender]
        old = s.process
        for w in self.writes.values():
            if w.sender == old and w.deadline is None:
                w.deadline = self.now + LIFETIME
        self.senders[sender] = _Sender(f"{sender}-p{int(old.rsplit('p', 1)[1]) + 1}")
        self.apply(self.ledger.writer_gone(old, now=self.now, lifetime=LIFETIME))

    @rule(sender=st.sampled_from(["a", "b"]), data=st.data())
    def session_lost_and_transport_revokes(self, sender: str, data: st.DataObject) -> None:
        """After a session loss the links the sender opened so far are cut: nothing more lands
        through them (its new session opens a new link)."""
        s = self.senders[sender]
        writer = self.writer_of(sender)
        self._rooms_see_the_loss(writer, FenceReason.SESSION_DROPPED, data)
        s.epoch += 1
        for wid in [w.id for w in self.writes.values() if w.sender == s.process and w.epoch < s.epoch]:
            del self.writes[wid]
        self.apply(self.ledger.revoked(s.process, below_epoch=s.epoch))

    @rule()
    def loop_stalls(self) -> None:
        self.ledger.loop_stalled(self.now)

    @rule(dt=st.sampled_from([0.05, 0.3, 1.0, 2.5]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for wid in [w.id for w in self.writes.values() if w.deadline is not None and w.deadline <= self.now]:
            del self.writes[wid]  # a gone writer's write has landed by its deadline
        self.apply(self.ledger.tick(self.now))

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def free_blocks_are_unreachable_and_unowned(self) -> None:
        for w in self.writes.values():
            assert not set(w.blocks) & self.free, f"write {w} may reach free blocks"
        for b in range(NUM_BLOCKS):
            assert (self.ledger.owner_of(b) is None) == (b in self.free)

    @invariant()
    def fenced_blocks_match_the_ledger(self) -> None:
        assert self.fenced == {b for g in self.ledger.grants(state=GrantState.FENCED) for b in g.blocks}

    @invariant()
    def deadlines_are_in_the_future_or_due(self) -> None:
        d = self.ledger.next_deadline()
        assert d is None or d >= 0


TestBlockLedger = BlockLedgerMachine.TestCase
TestBlockLedger.settings = settings(STATEFUL, max_examples=300)


# -- the sender's write ledger ------------------------------------------------------------------


@dataclass(eq=False)
class _SenderWrite:
    id: int
    session: SessionKey
    room: str
    source: int
    may_land_until: float | None = None  # None: in flight
    lifetime_ends: float = 0.0  # poisoned: when the transport's write lifetime ends


@dataclass
class _WriteModel:
    open: dict[str, int] = field(default_factory=dict)  # receiver -> open epoch
    writes: dict[int, _SenderWrite] = field(default_factory=dict)
    sources: dict[int, bool] = field(default_factory=dict)  # source -> send() running
    released: set[int] = field(default_factory=set)
    told: set[tuple[SessionKey, str]] = field(default_factory=set)


class WriteLedgerMachine(RuleBasedStateMachine):
    """The sender may promise 'writes over' (FENCE_RELEASE, DRAINED, source release) only when true."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = WriteLedger()
        self.m = _WriteModel()
        self.now = 0.0
        self.epochs = {"r0": 0, "r1": 0}

    def may_land(self, w: _SenderWrite) -> bool:
        return w.may_land_until is None or w.may_land_until > self.now

    def apply(self, actions: list[object]) -> None:
        for a in actions:
            live = [w for w in self.m.writes.values() if self.may_land(w)]
            if isinstance(a, SendFenceRelease):
                assert (a.session, a.room) in self.m.told, "FENCE_RELEASE before the room's STATUS(fence=True)"
                assert not [w for w in live if w.session == a.session and w.room == a.room]
                assert self.m.open.get(a.session.receiver) == a.session.epoch
            elif isinstance(a, SendDrained):
                assert a.below_epoch == a.session.epoch == self.m.open.get(a.session.receiver)
                assert not [w for w in live if w.session.receiver == a.session.receiver
                            and w.session.epoch < a.below_epoch]
            elif isinstance(a, ReleaseSource):
                assert not self.m.sources.get(a.source, True), "source released while send() runs"
                assert not [w for w in live if w.source == a.source]
                self.m.released.add(a.source)
            else:
                assert isinstance(a, DrainedSession)
                assert not [w for w in live if w.session == a.session]
        for wid in [w.id for w in self.m.writes.values() if not self.may_land(w)]:
            del self.m.writes[wid]

    @initialize()
    def start(self) -> None:
        for r in self.epochs:
            self.open_session(r)

    @rule(receiver=st.sampled_from(["r0", "r1"]))
    def open_session(self, receiver: str) -> None:
        self.epochs[receiver] += 1
        key = SessionKey(receiver, self.epochs[receiver])
        self.m.open[receiver] = key.epoch  # an older open session of the receiver closes with it
        self.apply(self.ledger.session_opened(key))

    @rule(receiver=st.sampled_from(["r0", "r1"]))
    def close_session(self, receiver: str) -> None:
        if receiver in self.m.open:
            key = SessionKey(receiver, self.m.open.pop(receiver))
            self.apply(self.ledger.session_closed(key))

    @rule()
    def new_source(self) -> None:
        self.m.sources[self.ledger.new_source()] = True

    @rule(data=st.data(), receiver=st.sampled_from(["r0", "r1"]), room=st.sampled_from(["x", "y"]))
    def start_write(self, data: st.DataObject, receiver: str, room: str) -> None:
        running = [s for s, r in self.m.sources.items() if r]
        if receiver not in self.m.open or not running:
            return
        key = SessionKey(receiver, self.m.open[receiver])
        source = data.draw(st.sampled_from(running))
        wid = self.ledger.started(key, room, source)
        self.m.writes[wid] = _SenderWrite(wid, key, room, source)

    @rule(data=st.data(), outcome=st.sampled_from(list(WriteOutcome)), lifetime=st.sampled_from([0.0, 0.5, 2.0]),
          settling=st.booleans())
    def end_write(self, data: st.DataObject, outcome: WriteOutcome, lifetime: float, settling: bool) -> None:
        flying = [w for w in self.m.writes.values() if w.may_land_until is None]
        if not flying:
            return
        w = data.draw(st.sampled_from(flying))
        settling = settling and outcome is WriteOutcome.POISONED
        if outcome is WriteOutcome.POISONED:
            w.lifetime_ends = self.now + lifetime
            w.may_land_until = math.inf if settling else w.lifetime_ends  # settling: until the transport says
        else:
            w.may_land_until = self.now  # over now
        self.apply(self.ledger.ended(w.id, outcome, now=self.now, lifetime=lifetime, settling=settling))

    @rule(data=st.data(), margin=st.sampled_from([0.0, 0.5, 3.0]))
    def write_settles(self, data: st.DataObject, margin: float) -> None:
        """The transport saw a settling write's last transfer end: it may land for ``margin`` more, and
        never less than its write lifetime."""
        settling = [w for w in self.m.writes.values() if w.may_land_until == math.inf]
        if not settling:
            return
        w = data.draw(st.sampled_from(settling))
        w.may_land_until = max(w.lifetime_ends, self.now + margin)
        self.apply(self.ledger.settled(w.id, now=self.now, margin=margin))

    @rule(data=st.data())
    def fence_status_sent(self, data: st.DataObject) -> None:
        """notify_end sent STATUS(fence=True) for a (session, room) with a poisoned write."""
        poisoned = [w for w in self.m.writes.values() if w.may_land_until is not None and self.may_land(w)
                    and self.m.open.get(w.session.receiver) == w.session.epoch]
        if poisoned:
            w = data.draw(st.sampled_from(poisoned))
            self.m.told.add((w.session, w.room))
            self.apply(self.ledger.fence_told(w.session, w.room))

    @rule(data=st.data())
    def send_returns(self, data: st.DataObject) -> None:
        running = [s for s, r in self.m.sources.items() if r]
        if running:
            s = data.draw(st.sampled_from(running))
            self.m.sources[s] = False
            self.apply(self.ledger.source_done(s))

    @rule(dt=st.sampled_from([0.1, 0.6, 2.5]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self.apply(self.ledger.tick(self.now))

    @rule()
    def loop_stalls(self) -> None:
        self.ledger.loop_stalled(self.now, 2.0)
        for w in self.m.writes.values():
            if w.may_land_until is not None and w.may_land_until > self.now:
                w.lifetime_ends = max(w.lifetime_ends, self.now + 2.0)
                w.may_land_until = max(w.may_land_until, self.now + 2.0)

    @invariant()
    def ledger_counts_what_may_land(self) -> None:
        assert len(self.ledger) >= len([w for w in self.m.writes.values() if self.may_land(w)])


TestWriteLedger = WriteLedgerMachine.TestCase
TestWriteLedger.settings = STATEFUL


# -- the table, one transition at a time -------------------------------------------------------

W = Writer("p1", 1, "tcp://s")


def _announced(ledger: BlockLedger, blocks: tuple[int, ...] = (0, 1)) -> int:
    g = ledger.reserve("r", blocks)
    ledger.announce(g, W)
    return g


def test_every_state_lists_its_events() -> None:
    assert set(TRANSITIONS) == set(GrantState)
    assert TRANSITIONS[GrantState.FREE] == frozenset()


def test_reserve_refuses_blocks_held_by_a_live_grant() -> None:
    ledger = BlockLedger()
    g = _announced(ledger)
    with pytest.raises(OwnershipError, match="already held"):
        ledger.reserve("other", (1, 2))
    ledger.fence(g, FenceReason.PEER_SILENT)
    with pytest.raises(OwnershipError, match="already held"):  # fenced: still never re-announced
        ledger.reserve("other", (0,))


def test_silence_fences_and_never_frees() -> None:
    ledger = BlockLedger()
    g = _announced(ledger)
    (fence,) = ledger.fence(g, FenceReason.PEER_SILENT)
    assert isinstance(fence, Fence) and fence.reason is FenceReason.PEER_SILENT and fence.blocks == (0, 1)
    assert ledger.tick(1e9) == []  # no amount of silence frees it
    assert ledger.fence(g, FenceReason.PEER_SILENT) == []
    (free,) = ledger.drained("p1", 2, now=0.0)
    assert isinstance(free, Free) and free.proof is Proof.DRAINED and free.grant == g


def test_what_is_known_about_a_sender_applies_to_grants_fenced_later() -> None:
    ledger = BlockLedger()
    g1 = _announced(ledger, (0,))
    g2 = ledger.reserve("r2", (1,))
    ledger.announce(g2, W)
    assert ledger.drained("p1", 2, now=0.0, settle=0.5) == []  # announced: their rooms decide
    assert ledger.grant(g1).state is GrantState.ANNOUNCED
    ledger.fence(g1, FenceReason.SESSION_DROPPED, now=10.0)  # the room sees the loss later
    assert ledger.tick(10.4) == []
    (free,) = ledger.tick(10.5)
    assert free.grant == g1 and free.proof is Proof.DRAINED
    ledger.revoked("p1", below_epoch=2)
    _fence, free = ledger.fence(g2, FenceReason.PEER_SILENT, now=20.0)
    assert isinstance(free, Free) and free.proof is Proof.REVOKED and free.grant == g2


def test_a_drain_never_covers_sessions_from_its_bound_on() -> None:
    ledger = BlockLedger()
    ledger.drained("p1", 2, now=0.0)  # sessions 1 are drained
    g = ledger.reserve("r", (0,))
    ledger.announce(g, Writer("p1", 2, "tcp://s"))  # announced in session 2
    ledger.fence(g, FenceReason.ABORT_UNACKED, now=1.0)
    assert ledger.tick(1e9) == [] and ledger.grant(g).state is GrantState.FENCED
    ledger.revoked("p1", below_epoch=2)
    assert ledger.grant(g).state is GrantState.FENCED


def test_drained_of_another_process_or_a_later_session_frees_nothing() -> None:
    ledger = BlockLedger()
    g = _announced(ledger)
    ledger.fence(g, FenceReason.SESSION_DROPPED)
    assert ledger.drained("p2", 5, now=0.0) == []  # a restarted process cannot vouch for p1
    assert ledger.drained("p1", 1, now=0.0) == []  # only sessions before 1: none
    assert ledger.grant(g).state is GrantState.FENCED


def test_fence_release_waits_out_the_settle_window_and_restarts_after_a_stall() -> None:
    ledger = BlockLedger()
    g = _announced(ledger)
    ledger.fence(g, FenceReason.WRITE_FAILED)
    assert ledger.fence_released(W, "r", now=10.0, settle=0.2) == []
    assert ledger.next_deadline() == pytest.approx(10.2)
    ledger.loop_stalled(10.15)
    assert ledger.tick(10.3) == []  # the window started again at the stall
    (free,) = ledger.tick(10.35)
    assert isinstance(free, Free) and free.proof is Proof.FENCE_RELEASE


def test_fence_release_for_an_announced_grant_is_ignored() -> None:
    ledger = BlockLedger()
    g = _announced(ledger)
    assert ledger.fence_released(W, "r", now=0.0, settle=0.0) == []
    assert ledger.grant(g).state is GrantState.ANNOUNCED


def test_writer_gone_frees_after_the_lifetime_unless_it_comes_back() -> None:
    ledger = BlockLedger()
    g = _announced(ledger)
    ledger.fence(g, FenceReason.SESSION_DROPPED, now=0.0)
    assert ledger.writer_gone("p1", now=0.0, lifetime=5.0) == []
    assert ledger.next_deadline() == 5.0
    ledger.writer_back("p1")  # it answered again: it was not gone
    assert ledger.tick(100.0) == []
    ledger.writer_gone("p1", now=100.0, lifetime=5.0)
    assert ledger.tick(104.0) == []
    (free,) = ledger.tick(105.0)
    assert isinstance(free, Free) and free.proof is Proof.WRITER_GONE and free.grant == g


def test_readable_grants_are_untouched_by_writer_events() -> None:
    ledger = BlockLedger()
    g = _announced(ledger)
    assert ledger.landed(g) == []
    for actions in (ledger.drained("p1", 9, now=0.0), ledger.revoked("p1", below_epoch=9),
                    ledger.writer_gone("p1", now=0.0, lifetime=0.0), ledger.tick(1e9)):
        assert actions == []
    (free,) = ledger.consumed(g)
    assert isinstance(free, Free) and free.proof is Proof.CONSUMED


def test_late_answers_free_only_the_round_they_prove() -> None:
    ledger = BlockLedger()
    g0 = ledger.reserve("r", (0,), round=0)
    ledger.announce(g0, W)
    g1 = ledger.reserve("r", (1,), round=1)
    ledger.announce(g1, W)
    ledger.fence(g0, FenceReason.ABORT_UNACKED)
    ledger.fence(g1, FenceReason.ABORT_UNACKED)
    (free,) = ledger.late_answer(W, "r", Proof.STATUS, round=1)
    assert free.grant == g1
    (free,) = ledger.late_answer(W, "r", Proof.ABORT_ACK)
    assert free.grant == g0


def test_a_late_answer_frees_a_failed_writes_grant_only_after_the_settle() -> None:
    """The writer answers (ABORT_ACK) once its failed write can no longer be sent, as with FENCE_RELEASE:
    bytes it sent may still sit in our socket buffers, so the grant waits out the same settle."""
    ledger = BlockLedger()
    failed = _announced(ledger, (0,))
    ledger.fence(failed, FenceReason.WRITE_FAILED)
    other = ledger.reserve("r", (5,), round=1)
    ledger.announce(other, W)
    ledger.fence(other, FenceReason.ABORT_UNACKED)
    (free,) = ledger.late_answer(W, "r", Proof.ABORT_ACK, now=10.0, settle=0.2)
    assert free.grant == other  # its write ended normally: freed at once
    assert ledger.grant(failed).state is GrantState.FENCED and ledger.next_deadline() == 10.2
    assert ledger.tick(10.1) == []
    (free,) = ledger.tick(10.2)
    assert isinstance(free, Free) and free.grant == failed and free.proof is Proof.ABORT_ACK


@pytest.mark.parametrize("event", ["landed", "consumed", "ended", "fence"])
def test_illegal_events_raise_and_change_nothing(event: str) -> None:
    ledger = BlockLedger()
    g = ledger.reserve("r", (3,))
    call = {
        "landed": lambda: ledger.landed(g),
        "consumed": lambda: ledger.consumed(g),
        "ended": lambda: ledger.ended(g, Proof.STATUS),
        "fence": lambda: ledger.fence(g, FenceReason.PEER_SILENT),
    }[event]
    with pytest.raises(OwnershipError, match="illegal in state RESERVED"):
        call()
    assert ledger.grant(g).state is GrantState.RESERVED


def _one_write() -> tuple[WriteLedger, SessionKey, int, int]:
    """A ledger with one session open and one write of ``room`` in flight: (ledger, session, source, write)."""
    ledger = WriteLedger()
    key = SessionKey("r", 1)
    ledger.session_opened(key)
    src = ledger.new_source()
    return ledger, key, src, ledger.started(key, "room", src)


def test_write_ledger_holds_fence_release_until_the_fence_status() -> None:
    ledger, key, src, w = _one_write()
    assert ledger.ended(w, WriteOutcome.POISONED, now=0.0, lifetime=0.0) == []  # expired, but not yet told
    assert ledger.fence_told(key, "room") == [SendFenceRelease(key, "room")]
    assert ledger.source_done(src) == [ReleaseSource(src)]


@pytest.mark.parametrize("outcome", [WriteOutcome.LANDED, WriteOutcome.FAILED_CLEANLY])
def test_a_fence_told_while_a_clean_write_runs_is_released_when_it_ends(outcome: WriteOutcome) -> None:
    """The fence was told about a room whose write was still going and then landed (or failed cleanly): the
    FENCE_RELEASE it is owed was sent only after poisoned writes, so it never came."""
    ledger, key, src, w = _one_write()
    assert ledger.fence_told(key, "room") == []  # the write is still in flight
    assert ledger.ended(w, outcome, now=0.0, lifetime=3.0) == [SendFenceRelease(key, "room")]
    assert ledger.source_done(src) == [ReleaseSource(src)]


def test_a_settling_write_lands_until_its_transport_says_it_ended_and_its_lifetime_passed() -> None:
    ledger, key, src, w = _one_write()
    assert ledger.ended(w, WriteOutcome.POISONED, now=0.0, lifetime=3.0, settling=True) == []
    assert ledger.fence_told(key, "room") == []
    assert ledger.source_done(src) == []  # the engine may still read the source
    assert ledger.tick(1e6) == [] and ledger.next_deadline() is None  # no time alone ends it
    assert ledger.settled(w, now=1.0, margin=0.5) == []  # ended, but its write lifetime runs to 3.0
    assert ledger.next_deadline() == 3.0 and ledger.tick(2.9) == []
    assert ledger.tick(3.0) == [SendFenceRelease(key, "room"), ReleaseSource(src)]
    w2 = ledger.started(key, "room", ledger.new_source())
    ledger.ended(w2, WriteOutcome.POISONED, now=10.0, lifetime=1.0, settling=True)
    ledger.settled(w2, now=20.0, margin=2.0)
    assert ledger.next_deadline() == 22.0
    with pytest.raises(OwnershipError, match="not waiting to settle"):
        ledger.settled(w2, now=21.0, margin=2.0)
    with pytest.raises(OwnershipError, match="only a poisoned write"):
        ledger.ended(ledger.started(key, "room", ledger.new_source()), WriteOutcome.LANDED, now=0.0, lifetime=1.0,
                     settling=True)


def test_write_ledger_drains_a_replaced_session_once_its_writes_end() -> None:
    ledger = WriteLedger()
    k1, k2 = SessionKey("r", 1), SessionKey("r", 2)
    ledger.session_opened(k1)
    src = ledger.new_source()
    w = ledger.started(k1, "room", src)
    assert ledger.session_opened(k2) == []  # session 1 still has a write in flight: no DRAINED yet
    with pytest.raises(OwnershipError, match="closed session"):
        ledger.started(k1, "room", src)  # never a new write into a session that ended
    actions = ledger.ended(w, WriteOutcome.POISONED, now=0.0, lifetime=3.0)
    assert not [a for a in actions if isinstance(a, SendDrained)]
    actions = ledger.tick(3.0)
    assert SendDrained(k2, 2) in actions and DrainedSession(k1) in actions


def test_split_hands_landed_blocks_to_the_reader_and_fences_only_the_rest() -> None:
    ledger = BlockLedger()
    w = Writer("p1", 1)
    gid = ledger.reserve("r", (4, 5, 6, 7))
    with pytest.raises(OwnershipError, match="split"):
        ledger.split(gid, 2)  # RESERVED: nobody wrote anything yet
    ledger.announce(gid, w)
    for bad in (0, 4):
        with pytest.raises(OwnershipError, match="at least one must stay announced"):
            ledger.split(gid, bad)
    head = ledger.split(gid, 3)
    assert ledger.grant(head).blocks == (4, 5, 6) and ledger.grant(head).state is GrantState.READABLE
    assert ledger.grant(gid).blocks == (7,) and ledger.owner_of(4) is ledger.grant(head)
    # the room fails mid-round: only the block still being written is fenced
    (fence,) = ledger.fence(gid, FenceReason.ABORT_UNACKED)
    assert isinstance(fence, Fence) and fence.blocks == (7,)
    (free,) = ledger.consumed(head)  # the reader lets go of the landed rows
    assert isinstance(free, Free) and free.blocks == (4, 5, 6) and free.proof is Proof.CONSUMED
    (late,) = ledger.ended(gid, Proof.ABORT_ACK)
    assert late.blocks == (7,) and len(ledger) == 0


def test_trim_keeps_the_rows_blocks_of_a_readable_grant_and_frees_the_rest() -> None:
    ledger = BlockLedger()
    gid = ledger.reserve("r", (4, 5, 6, 7))
    ledger.announce(gid, Writer("p1", 1))
    with pytest.raises(OwnershipError, match="trim is illegal in state ANNOUNCED"):
        ledger.trim(gid, 1)  # its writes may still be going on
    assert ledger.landed(gid) == []
    for bad in (0, 5):
        with pytest.raises(OwnershipError, match="cannot keep"):
            ledger.trim(gid, bad)
    assert ledger.trim(gid, 4) == []  # every block holds rows
    (free,) = ledger.trim(gid, 1)
    assert isinstance(free, Free) and free.blocks == (5, 6, 7) and free.proof is Proof.CONSUMED
    assert ledger.grant(gid).blocks == (4,) and ledger.owner_of(4) is ledger.grant(gid)
    assert ledger.owner_of(5) is None
    (last,) = ledger.consumed(gid)
    assert last.blocks == (4,) and len(ledger) == 0


def _remembered(ledger: BlockLedger) -> set[str]:
    return set(ledger._drained_below) | set(ledger._revoked_below) | set(ledger._gone)


def test_proofs_about_a_sender_are_kept_only_while_one_of_its_grants_is_live() -> None:
    # Every sender process a receiver ever saw stayed in these tables (found by a reviewer: ~170 bytes a
    # process, for the life of the receiver).
    ledger = BlockLedger()
    for i in range(1000):  # processes that came and went with nothing of theirs in the pool
        ledger.drained(f"old{i}", 2, now=0.0)
        ledger.revoked(f"old{i}", below_epoch=2)
        ledger.writer_gone(f"old{i}", now=0.0, lifetime=1.0)
    assert _remembered(ledger) == set()
    g = _announced(ledger)  # while one of p1's grants is live, what is known about p1 still applies to it
    ledger.drained("p1", 2, now=0.0, settle=0.5)
    assert _remembered(ledger) == {"p1"}
    ledger.fence(g, FenceReason.SESSION_DROPPED, now=10.0)  # its room sees the loss later
    assert ledger.tick(10.4) == []
    (free,) = ledger.tick(10.5)
    assert free.grant == g and free.proof is Proof.DRAINED
    assert _remembered(ledger) == set()
