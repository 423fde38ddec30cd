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
from aioembed.protocol.messages import RoomId, Status, TransferStatus

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
    """Rows ``[start, start + count)`` of the request are in the current blocks.

    ``complete`` is true on the last round; otherwise ``remaining`` tokens still have to come
    and the caller reserves blocks for (part of) them and calls ``resume_sent``.
    """

    start: int
    count: int
    total: int
    complete: bool
    metadata: dict[str, object] | None

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
        self.total: int | None = None
        self.allocated = 0
        self.error: str | None = None
        self._awaiting_status = False

    def _bad(self, what: str, *, room: RoomId | None = None) -> ProtocolError:
        return ProtocolError(f"room {self.room!r}: {what} (state {self.state.name})", room=self.room)

    def _illegal(self, what: str) -> ProtocolError:
        return ProtocolError(f"room {self.room!r}: {what} is illegal in state {self.state.name}", room=self.room)

    def init_sent(self, *, blocks: int, allocated_tokens: int) -> None:
        """The first reservation went out in an INIT."""
        if self.state is not TransferStatus.BOOTSTRAPPING:
            raise self._illegal("INIT")
        if not _blocks_hold(blocks, self.block_size, allocated_tokens):
            raise self._bad(f"{allocated_tokens} tokens do not fit {blocks} blocks",
                                room=self.room)
        self.allocated = allocated_tokens
        self.state = TransferStatus.WAITING_FOR_INPUT
        self._awaiting_status = True

    def resume_sent(self, *, blocks: int, allocated_tokens: int) -> None:
        """The next round's reservation went out in a RESUME (round number already advanced)."""
        if self.state is not TransferStatus.TRANSFERRING or self._awaiting_status:
            raise self._illegal("RESUME")
        assert self.total is not None
        remaining = self.total - self.received
        if not _blocks_hold(blocks, self.block_size, allocated_tokens) or allocated_tokens > remaining:
            raise self._bad(
                f"RESUME reserves {allocated_tokens} tokens in {blocks} blocks "
                f"for {remaining} remaining tokens", room=self.room)
        self.allocated = allocated_tokens
        self.round += 1
        self._awaiting_status = True

    def on_status(self, msg: Status) -> Arrived | None:
        """A STATUS came. Returns the rows that arrived, or ``None`` if the room failed.

        Raises ``ProtocolError`` for a STATUS that does not fit the reservation or the round.
        """
        if self.state.terminal:
            raise self._illegal("STATUS")
        if msg.state in (TransferStatus.FAILED, TransferStatus.ABORTED):
            self.state = msg.state
            self.error = msg.error or f"sender reported {msg.state.name}"
            self._awaiting_status = False
            return None
        if not self._awaiting_status:
            raise self._illegal(f"STATUS {msg.state} (no reservation outstanding)")
        if msg.state not in (TransferStatus.TRANSFERRING, TransferStatus.SUCCESS):
            raise self._bad(f"sender reported state {msg.state.name} with data", room=self.room)
        if msg.round != self.round:
            raise self._bad(f"STATUS for round {msg.round}, expected round {self.round}",
                                room=self.room)
        total = msg.total_tokens
        if total < 1 or total > self.max_tokens:
            raise self._bad(
                f"request of {total} tokens, allowed 1..{self.max_tokens} (max_request_tokens)",
                room=self.room)
        if self.total is not None and total != self.total:
            raise self._bad(f"total changed from {self.total} to {total}", room=self.room)
        count = msg.sent_tokens - self.received
        expected = min(self.allocated, total - self.received)
        if count != expected:
            raise self._bad(
                f"round {self.round} brought {count} tokens, expected {expected} "
                f"(received {self.received}, reserved {self.allocated}, total {total})", room=self.room)
        complete = msg.sent_tokens == total
        if complete != (msg.state is TransferStatus.SUCCESS):
            raise self._bad(
                f"state {msg.state.name} with {msg.sent_tokens} of {total} tokens sent",
                room=self.room)
        start = self.received
        self.total = total
        self.received = msg.sent_tokens
        self._awaiting_status = False
        self.state = TransferStatus.SUCCESS if complete else TransferStatus.TRANSFERRING
        return Arrived(start=start, count=count, total=total, complete=complete, metadata=msg.metadata)

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
                num_blocks: int | None = None) -> None:
        """A rank's INIT arrived."""
        if self.failed is not None:
            raise self._err("INIT after the room ended")
        if self.expected_ranks is not None and expected_ranks != self.expected_ranks:
            raise self._err(f"INIT from rank {rank} expects {expected_ranks} ranks, others said {self.expected_ranks}")
        if not 0 <= rank < expected_ranks:
            raise self._err(f"INIT from rank {rank}, outside world of {expected_ranks}")
        if rank in self.ranks:
            raise self._err(f"duplicate INIT from rank {rank}")
        self._check_reservation(blocks, allocated_tokens, num_blocks)
        self.expected_ranks = expected_ranks
        self.ranks[rank] = _Rank(RankPhase.READY, blocks, allocated_tokens)

    def on_input(self, total_tokens: int) -> None:
        """``send()`` supplied the request: ``total_tokens`` rows."""
        if self.failed is not None:
            raise self._err("input after the room ended")
        if self.total is not None:
            raise self._err("the room's input was already given (duplicate send for this room?)")
        if total_tokens < 1:
            raise self._err(f"a request needs at least one token, got {total_tokens}")
        self.total = total_tokens

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

    def write_done(self, task: WriteTask, *, metadata: dict[str, object] | None = None) -> Status:
        """The write of ``task`` is visible at the rank; returns the STATUS to send it."""
        p = self.ranks.get(task.rank)
        if p is None or p.phase is not RankPhase.WRITING or p.round != task.round or self.total is None:
            raise self._err(f"write completion for rank {task.rank} round {task.round} was not expected")
        p.sent = task.start + task.count
        done = p.sent == self.total
        p.phase = RankPhase.DONE if done else RankPhase.AWAITING_RESUME
        return Status(
            room=self.room, state=TransferStatus.SUCCESS if done else TransferStatus.TRANSFERRING,
            total_tokens=self.total,
            sent_tokens=p.sent, round=p.round, metadata=metadata if done else None,
        )

    def on_resume(self, rank: int, *, round: int, sent_tokens: int, blocks: tuple[int, ...],
                  allocated_tokens: int, num_blocks: int | None = None) -> None:
        """A rank's RESUME arrived with a fresh reservation."""
        if self.failed is not None:
            raise self._err(f"RESUME from rank {rank} after the room ended")
        p = self.ranks.get(rank)
        if p is None or p.phase is not RankPhase.AWAITING_RESUME or self.total is None:
            raise self._err(f"RESUME from rank {rank} was not expected")
        if round != p.round + 1:
            raise self._err(f"RESUME from rank {rank} for round {round}, expected round {p.round + 1}")
        if sent_tokens != p.sent:
            raise self._err(f"RESUME from rank {rank} says {sent_tokens} tokens arrived, {p.sent} were sent")
        if allocated_tokens > self.total - p.sent:
            raise self._err(f"RESUME reserves {allocated_tokens} tokens, only {self.total - p.sent} remain")
        self._check_reservation(blocks, allocated_tokens, num_blocks)
        p.round, p.blocks, p.allocated, p.phase = round, blocks, allocated_tokens, RankPhase.READY

    def writing(self, rank: int) -> bool:
        """True while a write into ``rank``'s blocks may be in flight."""
        p = self.ranks.get(rank)
        return p is not None and p.phase is RankPhase.WRITING

    def fail(self, reason: str, *, aborted: bool = False, even_if_complete: bool = False) -> None:
        """End the room as FAILED or ABORTED (no-op if already ended). ``even_if_complete``: also when
        every rank holds every token, because a rank was never told so (its STATUS could not be sent)."""
        if self.failed is None and (even_if_complete or self.state is not TransferStatus.SUCCESS):
            self.failed = TransferStatus.ABORTED if aborted else TransferStatus.FAILED
            self.error = reason
