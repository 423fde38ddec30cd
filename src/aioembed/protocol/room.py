"""Per-room state machines of both sides. Sans-IO: no sockets, tasks or clocks.

The I/O layer feeds events in (a message arrived, a write finished, blocks were reserved)
and gets back what to do next (copy rows out, reserve blocks, write a token range, send a
STATUS). Every check that protects memory lives here: a round must fill exactly what was
reserved, counts may never exceed a reservation, rounds must follow each other. An illegal
event raises :class:`ProtocolError` naming the room and the state, and leaves the machine
unchanged, so the caller can fail the room cleanly.

Rounds are told apart by explicit round numbers and token offsets, never by counting frames.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from aioembed.errors import ProtocolError
from aioembed.protocol.messages import Progress, RoomId, Status, Total, TransferStatus

__all__ = [
    "Arrived",
    "RankPhase",
    "ReceiverRoomState",
    "SenderRoomState",
    "TransferStatus",
    "WriteTask",
]


def _blocks_hold(blocks: int, block_size: int, tokens: int) -> bool:
    """A reservation of ``tokens`` must fit its blocks and use every one of them."""
    return 0 < tokens <= blocks * block_size and tokens > (blocks - 1) * block_size


# -- receiver side --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrived:
    """Rows ``[start, start + count)`` of the request are in the current blocks, from token
    ``offset`` of the current round's reservation on (``offset`` is 0 unless ``PROGRESS`` frames
    announced earlier rows of the round).

    ``partial``: a ``PROGRESS`` within the round (more rows of the round follow). Otherwise the
    round is over: ``complete`` is true on the last round; else ``remaining`` tokens still have to
    come and the caller reserves blocks for (part of) them and calls ``resume_sent``. ``metadata`` is
    the room's metadata when this frame carried it (the sender's first announcement), else ``None``.
    """

    start: int
    count: int
    total: int
    complete: bool
    metadata: dict[str, object] | None
    partial: bool = False
    offset: int = 0

    @property
    def remaining(self) -> int:
        """Tokens still to come after this round."""
        return self.total - self.start - self.count


class ReceiverRoomState:
    """The language side's view of one room."""

    def __init__(self, room: RoomId, *, block_size: int, max_tokens: int) -> None:
        self.room = room
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.state = TransferStatus.BOOTSTRAPPING
        self.round = 0
        self.received = 0
        """Tokens whose round ended (its STATUS came)."""
        self.landed = 0
        """Tokens in place: ``received`` plus what ``PROGRESS`` announced of the current round."""
        self.total: int | None = None
        self.allocated = 0
        self.progress_tokens = 0
        self.metadata: dict[str, object] | None = None
        self.error: str | None = None
        self._awaiting_status = False
        self._ahead = 0
        """Tokens of the next round, announced (RESUME) before this round's STATUS came (0: none)."""

    def _bad(self, what: str, *, room: RoomId | None = None) -> ProtocolError:
        return ProtocolError(f"room {self.room!r}: {what} (state {self.state.name})", room=self.room)

    def _illegal(self, what: str) -> ProtocolError:
        return ProtocolError(f"room {self.room!r}: {what} is illegal in state {self.state.name}", room=self.room)

    def init_sent(self, *, blocks: int, allocated_tokens: int, progress_tokens: int = 0) -> None:
        """The first reservation went out in an INIT (asking for ``PROGRESS`` every ``progress_tokens``)."""
        if self.state is not TransferStatus.BOOTSTRAPPING:
            raise self._illegal("INIT")
        if not _blocks_hold(blocks, self.block_size, allocated_tokens):
            raise self._bad(f"{allocated_tokens} tokens do not fit {blocks} blocks",
                                room=self.room)
        if progress_tokens < 0 or progress_tokens % self.block_size:
            raise self._bad(f"progress_tokens={progress_tokens} must be 0 or a multiple of the block size "
                            f"{self.block_size}")
        self.progress_tokens = progress_tokens
        self.allocated = allocated_tokens
        self.state = TransferStatus.WAITING_FOR_INPUT
        self._awaiting_status = True

    @property
    def ahead(self) -> bool:
        """The next round is announced already (its RESUME went out before this round's STATUS came)."""
        return self._ahead > 0

    def resume_sent(self, *, blocks: int, allocated_tokens: int) -> tuple[int, int]:
        """The next round's reservation goes out in a RESUME: returns its round and the token it starts at.

        After this round's STATUS (the usual case), or *early*, while this round is still being written:
        only for a room whose total is known (TOTAL, a PROGRESS, an earlier STATUS) to go on past this round, and
        one round ahead at most. This round then fills its whole reservation, so the next one starts where it
        ends."""
        if self.state is not TransferStatus.TRANSFERRING:
            raise self._illegal("RESUME")
        if self._awaiting_status:
            if self._ahead or self.total is None:
                raise self._illegal("an early RESUME" if not self._ahead else "a second early RESUME")
            start = self.received + self.allocated
            remaining = self.total - start
            if remaining <= 0:
                raise self._illegal(f"an early RESUME (round {self.round} ends the request)")
        else:
            assert self.total is not None
            start = self.received
            remaining = self.total - start
        if not _blocks_hold(blocks, self.block_size, allocated_tokens) or allocated_tokens > remaining:
            raise self._bad(
                f"RESUME reserves {allocated_tokens} tokens in {blocks} blocks "
                f"for {remaining} remaining tokens", room=self.room)
        if self._awaiting_status:
            self._ahead = allocated_tokens
            return self.round + 1, start
        self.allocated = allocated_tokens
        self.round += 1
        self._awaiting_status = True
        return self.round, start

    def on_total(self, msg: Total) -> None:
        """The sender's TOTAL: the room is longer than round 0's reservation. Legal once, during round 0."""
        if self.state.terminal:
            raise self._illegal("TOTAL")
        # In round 0, before any rows landed, only a TOTAL can have made the total known.
        if self.total is not None or not self._awaiting_status or self.round != 0 or self.landed:
            raise self._illegal("TOTAL (once, while round 0 is written)")
        total = msg.total_tokens
        if total > self.max_tokens:
            raise self._bad(f"request of {total} tokens, allowed 1..{self.max_tokens} (max_request_tokens)")
        if total <= self.allocated:
            raise self._bad(f"TOTAL of {total} tokens, which round 0's reservation of {self.allocated} holds "
                            "(it is sent only for a longer room)")
        self.total = total
        self.state = TransferStatus.TRANSFERRING

    def _check_frame(self, what: str, round: int, total: int) -> int:
        """Checks shared by STATUS and PROGRESS with data; returns where the round's rows end."""
        if not self._awaiting_status:
            raise self._illegal(f"{what} (no reservation outstanding)")
        if round != self.round:
            raise self._bad(f"{what} for round {round}, expected round {self.round}", room=self.room)
        if total < 1 or total > self.max_tokens:
            raise self._bad(
                f"request of {total} tokens, allowed 1..{self.max_tokens} (max_request_tokens)",
                room=self.room)
        if self.total is not None and total != self.total:
            raise self._bad(f"total changed from {self.total} to {total}", room=self.room)
        return self.received + min(self.allocated, total - self.received)

    def _take_metadata(self, metadata: dict[str, object] | None) -> dict[str, object] | None:
        if metadata is None:
            return None
        if self.metadata is not None:
            raise self._bad("metadata sent twice (it comes with the sender's first announcement only)")
        self.metadata = metadata
        return metadata

    def on_progress(self, msg: Progress) -> Arrived:
        """A PROGRESS came: more rows of the current round are in place. Returns them.

        Raises ``ProtocolError`` unless the room asked for progress, the rows are new, block-aligned
        within the round and short of its end (the round's last rows come with its STATUS).
        """
        if self.state.terminal:
            raise self._illegal("PROGRESS")
        if not self.progress_tokens:
            raise self._bad("PROGRESS for a room that did not ask for it")
        end = self._check_frame("PROGRESS", msg.round, msg.total_tokens)
        upto = msg.sent_tokens
        if not self.landed < upto < end or (upto - self.received) % self.block_size:
            raise self._bad(
                f"PROGRESS up to token {upto}: expected a block boundary after {self.landed} and before the "
                f"round's end {end} (round starts at {self.received}, blocks of {self.block_size})")
        metadata = self._take_metadata(msg.metadata)
        start = self.landed
        self.total = msg.total_tokens
        self.landed = upto
        self.state = TransferStatus.TRANSFERRING
        return Arrived(start=start, count=upto - start, total=msg.total_tokens, complete=False, metadata=metadata,
                       partial=True, offset=start - self.received)

    def on_status(self, msg: Status) -> Arrived | None:
        """A STATUS came. Returns the rows that arrived, or ``None`` if the room failed.

        Raises ``ProtocolError`` for a STATUS that does not fit the reservation or the round.
        """
        if self.state.terminal:
            raise self._illegal("STATUS")
        if msg.state in (TransferStatus.FAILED, TransferStatus.ABORTED):
            if msg.inline:
                raise self._bad(f"STATUS {msg.state.name} carrying rows inline")
            self.state = msg.state
            self.error = msg.error or f"sender reported {msg.state.name}"
            self._awaiting_status = False
            self._ahead = 0
            return None
        if not self._awaiting_status:
            raise self._illegal(f"STATUS {msg.state} (no reservation outstanding)")
        if msg.state not in (TransferStatus.TRANSFERRING, TransferStatus.SUCCESS):
            raise self._bad(f"sender reported state {msg.state.name} with data", room=self.room)
        if msg.fence:  # a failed write may still land: it contradicts the data (see BlockKeeper.late_fence)
            raise self._bad(f"STATUS {msg.state.name} with fence (a fence comes with FAILED or ABORTED only)")
        total = msg.total_tokens
        end = self._check_frame("STATUS", msg.round, total)
        if msg.sent_tokens != end:
            raise self._bad(
                f"round {self.round} brought {msg.sent_tokens - self.received} tokens, expected "
                f"{end - self.received} (received {self.received}, reserved {self.allocated}, total {total})",
                room=self.room)
        complete = msg.sent_tokens == total
        if complete != (msg.state is TransferStatus.SUCCESS):
            raise self._bad(
                f"state {msg.state.name} with {msg.sent_tokens} of {total} tokens sent",
                room=self.room)
        metadata = self._take_metadata(msg.metadata)
        start = self.landed
        offset = start - self.received
        self.total = total
        self.received = self.landed = msg.sent_tokens
        self._awaiting_status = False
        self.state = TransferStatus.SUCCESS if complete else TransferStatus.TRANSFERRING
        if self._ahead:  # the next round was announced early: it is the one in flight now
            self.round += 1
            self.allocated, self._ahead = self._ahead, 0
            self._awaiting_status = True
        return Arrived(start=start, count=msg.sent_tokens - start, total=total, complete=complete,
                       metadata=metadata, offset=offset)

    def fail(self, reason: str) -> None:
        """End the room as FAILED (no-op if already terminal)."""
        if not self.state.terminal:
            self.state, self.error = TransferStatus.FAILED, reason

    def abort(self, reason: str) -> None:
        """End the room as ABORTED (no-op if already terminal)."""
        if not self.state.terminal:
            self.state, self.error = TransferStatus.ABORTED, reason


# -- sender side ----------------------------------------------------------------------------


class RankPhase(enum.Enum):
    """Progress of one destination rank of a room on the sender."""

    READY = "READY"
    """A reservation is in hand; waiting for the input or for a write slot."""
    WRITING = "WRITING"
    AWAITING_RESUME = "AWAITING_RESUME"
    DONE = "DONE"


@dataclass(frozen=True, slots=True)
class WriteTask:
    """Write request tokens ``[start, start + count)`` into ``blocks`` of ``rank``."""

    rank: int
    round: int
    start: int
    count: int
    blocks: tuple[int, ...]


@dataclass(slots=True)
class _Rank:
    phase: RankPhase
    blocks: tuple[int, ...]
    allocated: int
    sent: int = 0
    round: int = 0
    progress: int = 0
    """``PROGRESS`` every this many tokens within a round (0: none)."""
    landed: int = 0
    """Tokens announced (STATUS or PROGRESS)."""
    announced: bool = False
    """The room's metadata went out (with the first announcement)."""
    exact: int = 0
    """The rank's room is a part of exactly this many tokens (0: any length)."""
    ahead: tuple[int, tuple[int, ...], int] | None = None
    """(round, blocks, allocated tokens) of the next round, announced early: its RESUME came while the round
    before it was being written or due; written while that one is (:meth:`SenderRoomState.start_ahead`) or as
    soon as it ends."""
    ahead_started: bool = False
    """The write of the round ``ahead`` is under way (its STATUS waits for the round before it)."""


class SenderRoomState:
    """The encoder side's view of one room, with progress tracked per destination rank.

    Ranks progress independently (no cross-rank agreement is needed); the room is a
    success once ``expected_ranks`` distinct ranks each hold every token.
    """

    def __init__(self, room: RoomId, *, block_size: int, num_blocks: int | None = None) -> None:
        self.room = room
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.total: int | None = None
        self.expected_ranks: int | None = None
        self.ranks: dict[int, _Rank] = {}
        self.failed: TransferStatus | None = None
        self.error: str | None = None
        self.peer_lost = False
        """The room ended because a rank's receiver was lost (its session ended), not for a reason that came
        first: only then is the sender's error ``PeerDead``, which a caller may take as "route elsewhere"."""

    @property
    def state(self) -> TransferStatus:
        """The room's overall status."""
        if self.failed is not None:
            return self.failed
        if self.expected_ranks is not None and len(self.ranks) == self.expected_ranks and all(
            r.phase is RankPhase.DONE for r in self.ranks.values()
        ):
            return TransferStatus.SUCCESS
        if self.total is None:
            return TransferStatus.WAITING_FOR_INPUT if self.ranks else TransferStatus.BOOTSTRAPPING
        return TransferStatus.TRANSFERRING if self.ranks else TransferStatus.BOOTSTRAPPING

    def _err(self, what: str) -> ProtocolError:
        return ProtocolError(f"room {self.room!r}: {what} (state {self.state.name})", room=self.room)

    def _check_reservation(self, blocks: tuple[int, ...], allocated: int, num_blocks: int | None) -> None:
        if not _blocks_hold(len(blocks), self.block_size, allocated):
            raise self._err(f"{allocated} tokens do not fit exactly {len(blocks)} blocks of {self.block_size}")
        limit = num_blocks if num_blocks is not None else self.num_blocks
        if limit is not None:
            bad = [b for b in blocks if b >= limit]
            if bad:
                raise self._err(f"block ids {bad[:4]} are outside the receiver's pool of {limit} blocks")
        if len(set(blocks)) != len(blocks):
            raise self._err("duplicate block ids in a reservation")

    def on_init(self, rank: int, *, blocks: tuple[int, ...], allocated_tokens: int, expected_ranks: int,
                num_blocks: int | None = None, progress_tokens: int = 0, exact_tokens: int = 0) -> None:
        """A rank's INIT arrived (asking for ``PROGRESS`` every ``progress_tokens`` within a round; for a part
        of ``exact_tokens`` tokens, if not 0: an input of another length fails the room)."""
        if self.failed is not None:
            raise self._err("INIT after the room ended")
        if self.expected_ranks is not None and expected_ranks != self.expected_ranks:
            raise self._err(f"INIT from rank {rank} expects {expected_ranks} ranks, others said {self.expected_ranks}")
        if not 0 <= rank < expected_ranks:
            raise self._err(f"INIT from rank {rank}, outside world of {expected_ranks}")
        if rank in self.ranks:
            raise self._err(f"duplicate INIT from rank {rank}")
        self._check_reservation(blocks, allocated_tokens, num_blocks)
        if progress_tokens < 0 or progress_tokens % self.block_size:
            raise self._err(f"INIT from rank {rank} asks for PROGRESS every {progress_tokens} tokens: expected 0 or "
                            f"a multiple of the block size {self.block_size}")
        self.expected_ranks = expected_ranks
        self.ranks[rank] = _Rank(RankPhase.READY, blocks, allocated_tokens, progress=progress_tokens,
                                 exact=exact_tokens)
        self._check_exact()

    def on_input(self, total_tokens: int) -> None:
        """``send()`` supplied the request: ``total_tokens`` rows."""
        if self.failed is not None:
            raise self._err("input after the room ended")
        if self.total is not None:
            raise self._err("the room's input was already given (duplicate send for this room?)")
        if total_tokens < 1:
            raise self._err(f"a request needs at least one token, got {total_tokens}")
        self.total = total_tokens
        self._check_exact()

    def _check_exact(self) -> None:
        """A part's length against the input: a mismatch fails the room (every rank is told why)."""
        if self.total is None or self.failed is not None:
            return
        for rank, p in sorted(self.ranks.items()):
            if p.exact and p.exact != self.total:
                self.fail(f"send() gave {self.total} tokens for a part that rank {rank} expects to be exactly "
                          f"{p.exact} tokens long (the Part's end - start)")
                return

    def ready_ranks(self) -> list[int]:
        """Ranks that can be written now."""
        if self.total is None or self.failed is not None:
            return []
        return [r for r, p in self.ranks.items() if p.phase is RankPhase.READY]

    def start_write(self, rank: int) -> WriteTask:
        """Take the next write for ``rank`` (which must be ready)."""
        p = self.ranks.get(rank)
        if p is None or p.phase is not RankPhase.READY or self.total is None or self.failed is not None:
            raise self._err(f"no write is due for rank {rank}")
        count = min(p.allocated, self.total - p.sent)
        p.phase = RankPhase.WRITING
        return WriteTask(rank=rank, round=p.round, start=p.sent, count=count, blocks=p.blocks)

    def may_follow(self, task: WriteTask) -> bool:
        """True if a round of ``task``'s rank may be written while ``task`` is (see :meth:`ahead_ranks`)."""
        return self.total is not None and task.rank in self.ranks and task.start + task.count < self.total

    def ahead_ranks(self) -> list[int]:
        """Ranks whose next round can be written now, while the round before it still is: it was announced
        early, so its blocks belong to the room. Its announcements (PROGRESS, STATUS) wait for the STATUS of
        the round before it."""
        if self.total is None or self.failed is not None:
            return []
        return [r for r, p in self.ranks.items()
                if p.phase is RankPhase.WRITING and p.ahead is not None and not p.ahead_started]

    def start_ahead(self, rank: int) -> WriteTask:
        """Take the write of ``rank``'s round announced early, while the round before it is written (see
        :meth:`ahead_ranks`). Its :meth:`write_done` comes after that round's: the STATUS frames go in order."""
        if rank not in self.ahead_ranks():
            raise self._err(f"no write ahead is due for rank {rank}")
        p = self.ranks[rank]
        assert p.ahead is not None and self.total is not None
        round, blocks, allocated = p.ahead
        start = p.sent + p.allocated  # the round before fills its reservation: a round follows it
        p.ahead_started = True
        return WriteTask(rank=rank, round=round, start=start, count=min(allocated, self.total - start), blocks=blocks)

    def progress_points(self, task: WriteTask) -> list[int]:
        """Where, within ``task``, the rank wants a ``PROGRESS`` (block-aligned token positions, each
        short of the round's end); empty when it asked for none."""
        p = self.ranks.get(task.rank)
        if p is None or not p.progress:
            return []
        return list(range(task.start + p.progress, task.start + task.count, p.progress))

    def _writing(self, task: WriteTask, what: str) -> _Rank:
        p = self.ranks.get(task.rank)
        if p is None or p.phase is not RankPhase.WRITING or p.round != task.round or self.total is None:
            raise self._err(f"{what} for rank {task.rank} round {task.round} was not expected")
        return p

    def _metadata_once(self, p: _Rank, metadata: dict[str, object] | None) -> dict[str, object] | None:
        if p.announced:
            return None
        p.announced = True
        return metadata

    def write_progress(self, task: WriteTask, upto: int, *, metadata: dict[str, object] | None = None) -> Progress:
        """Rows of ``task`` up to token ``upto`` are visible at the rank; returns the PROGRESS to send."""
        p = self._writing(task, "PROGRESS")
        assert self.total is not None
        if upto not in self.progress_points(task) or upto <= p.landed:
            raise self._err(f"PROGRESS up to {upto} is not a progress point of round {task.round} to rank "
                            f"{task.rank} (announced up to {p.landed})")
        p.landed = upto
        return Progress(room=self.room, round=task.round, sent_tokens=upto, total_tokens=self.total,
                        metadata=self._metadata_once(p, metadata))

    def total_for(self, task: WriteTask) -> Total | None:
        """The TOTAL to send as ``task`` starts: for round 0 of a room longer than the rank's first reservation
        (the rank may then announce round 1 before round 0 ends); else None."""
        if task.round != 0:
            return None
        self._writing(task, "TOTAL")
        assert self.total is not None
        if task.start + task.count >= self.total:
            return None
        return Total(room=self.room, total_tokens=self.total)

    def write_done(self, task: WriteTask, *, metadata: dict[str, object] | None = None,
                   inline: tuple[tuple[int, bytes], ...] = ()) -> Status:
        """The write of ``task`` is visible at the rank; returns the STATUS to send it (with the room's
        ``metadata`` if this is the first announcement to the rank, and the rows of fields not written,
        ``inline``). A round announced early is due next, or is now the round being written if its write
        started ahead."""
        p = self._writing(task, "write completion")
        assert self.total is not None
        p.sent = p.landed = task.start + task.count
        done = p.sent == self.total
        if done:
            p.phase = RankPhase.DONE
        elif p.ahead is not None:
            (p.round, p.blocks, p.allocated), p.ahead = p.ahead, None
            p.phase = RankPhase.WRITING if p.ahead_started else RankPhase.READY
            p.ahead_started = False
        else:
            p.phase = RankPhase.AWAITING_RESUME
        return Status(
            room=self.room, state=TransferStatus.SUCCESS if done else TransferStatus.TRANSFERRING,
            total_tokens=self.total,
            sent_tokens=p.sent, round=task.round, metadata=self._metadata_once(p, metadata), inline=inline,
        )

    def on_resume(self, rank: int, *, round: int, sent_tokens: int, blocks: tuple[int, ...],
                  allocated_tokens: int, num_blocks: int | None = None) -> None:
        """A rank's RESUME arrived with a fresh reservation: after its round's STATUS, or early, while that
        round is written or due (one round ahead at most, and only if a round follows: that round then fills
        its reservation, so the next one starts where it ends)."""
        if self.failed is not None:
            raise self._err(f"RESUME from rank {rank} after the room ended")
        p = self.ranks.get(rank)
        if p is None or self.total is None:
            raise self._err(f"RESUME from rank {rank} was not expected")
        early = (p.phase in (RankPhase.READY, RankPhase.WRITING) and p.ahead is None
                 and p.sent + p.allocated < self.total)
        if not (early or p.phase is RankPhase.AWAITING_RESUME):
            raise self._err(f"RESUME from rank {rank} was not expected")
        start = p.sent + p.allocated if early else p.sent
        if round != p.round + 1:
            raise self._err(f"RESUME from rank {rank} for round {round}, expected round {p.round + 1}")
        if sent_tokens != start:
            raise self._err(f"RESUME from rank {rank} says {sent_tokens} tokens arrived, {start} were sent"
                            + (f" once round {p.round} ends" if early else ""))
        if allocated_tokens > self.total - start:
            raise self._err(f"RESUME reserves {allocated_tokens} tokens, only {self.total - start} remain")
        self._check_reservation(blocks, allocated_tokens, num_blocks)
        if early:
            p.ahead = (round, blocks, allocated_tokens)
            return
        p.round, p.blocks, p.allocated, p.phase = round, blocks, allocated_tokens, RankPhase.READY

    def writing(self, rank: int) -> bool:
        """True while a write into ``rank``'s blocks may be in flight."""
        p = self.ranks.get(rank)
        return p is not None and p.phase is RankPhase.WRITING

    def fail(self, reason: str, *, aborted: bool = False, even_if_complete: bool = False,
             peer_lost: bool = False) -> None:
        """End the room as FAILED or ABORTED (no-op if already ended). ``even_if_complete``: also when
        every rank holds every token, because a rank was never told so (its STATUS could not be sent).
        ``peer_lost``: the cause is a rank's lost receiver; kept (:attr:`peer_lost`) only if this call ends the
        room, so the first cause decides what the room's error says."""
        if self.failed is None and (even_if_complete or self.state is not TransferStatus.SUCCESS):
            self.failed = TransferStatus.ABORTED if aborted else TransferStatus.FAILED
            self.error = reason
            self.peer_lost = peer_lost
