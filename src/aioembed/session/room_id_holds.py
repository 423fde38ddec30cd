"""Room ids a receiver ended and may not open again yet, per sender connection (sans-IO).

Frames name a room by its id alone, so a frame about an attempt that ended here must never reach the id's
next attempt: the sender's REJECT of a RESUME that crossed the room's end would free the new attempt's
reservation as never written while the sender writes into it; an ABORT_ACK would fail it. Two holds keep
the id until nothing more can come about the earlier attempt:

- its ABORT is unanswered. The sender answers every ABORT once, with an ABORT_ACK or, while a write of the
  room may still land, ``STATUS(fence=True)``; a REJECT naming the room never answers it (it refused another
  frame). A new attempt of such an id is refused (``InvalidRequest``), as the README says.
- a barrier: the room ended with an error, so frames of ours about it (a RESUME, the ABORT) may still be
  on their way and be answered. A PING goes out after the end. The sender handles frames in the order they
  came and sends what it answers at once before it reads the next, so its PONG comes after those answers.
  The one answer it gives later, to an ABORT of a room whose ``send()`` still runs (sent once its writes
  are over), the first hold covers. A new attempt waits for that PONG before its INIT (one round trip,
  only after a failure).
"""

from __future__ import annotations

import uuid

from aioembed.protocol.messages import AbortAck, Reject, RoomId, Status

__all__ = ["RoomIdHolds"]

_NONCES = (1 << 62) - 1


class RoomIdHolds:
    """The held ids of one sender connection: ``room in holds`` while either hold stands."""

    def __init__(self) -> None:
        self._owed: dict[RoomId, float] = {}  # room -> when its ABORT went out
        self._overdue: set[RoomId] = set()  # told about once (overdue)
        self._barriers: dict[RoomId, int] = {}  # room -> the nonce of the PING after its end
        self._by_nonce: dict[int, RoomId] = {}  # and back: every PONG is looked up (heartbeats' too)
        self._nonce = uuid.uuid4().int & _NONCES  # unguessable, like the heartbeat PINGs'

    def __contains__(self, room: object) -> bool:
        return room in self._owed or room in self._barriers

    def __len__(self) -> int:
        return sum(self.counts().values())

    def counts(self) -> dict[str, int]:
        """Held ids by why: ``abort_unanswered`` (a new attempt is refused) and ``barrier`` (only the PONG is
        awaited: a new attempt waits one round trip)."""
        return {"abort_unanswered": len(self._owed), "barrier": len(self._barriers.keys() - self._owed.keys())}

    def owes_answer(self, room: RoomId) -> bool:
        """True while the ABORT of ``room`` is unanswered."""
        return room in self._owed

    def abort_sent(self, room: RoomId, now: float) -> None:
        """An ABORT of ``room`` went to the sender at ``now``."""
        self._owed[room] = now

    def overdue(self, now: float, after: float) -> list[RoomId]:
        """Rooms whose ABORT went unanswered for more than ``after`` seconds, each returned once: a live
        sender answers at once, so their ids, refused until it does, are worth a warning."""
        late = [room for room, sent in self._owed.items() if now - sent > after and room not in self._overdue]
        self._overdue.update(late)
        return late

    def ended(self, room: RoomId) -> int:
        """``room`` ended with an error: returns the nonce of the PING to send now (after its ABORT)."""
        self._nonce = (self._nonce + 1) & _NONCES
        earlier = self._barriers.get(room)
        if earlier is not None:
            del self._by_nonce[earlier]
        self._barriers[room] = self._nonce
        self._by_nonce[self._nonce] = room
        return self._nonce

    def late(self, msg: Status | AbortAck | Reject, room: RoomId) -> bool:
        """A frame of the sender for ``room``, no longer in flight here; True if it answered our ABORT."""
        if (isinstance(msg, AbortAck) or (isinstance(msg, Status) and msg.fence)) and room in self._owed:
            del self._owed[room]
            self._overdue.discard(room)
            return True
        return False

    def pong(self, nonce: int) -> bool:
        """The sender answered PING ``nonce``: True if it was an id's barrier (the id is still held if its
        ABORT is unanswered)."""
        if nonce not in self._by_nonce:
            return False
        del self._barriers[self._by_nonce.pop(nonce)]
        return True

    def session_ended(self) -> None:
        """The sender ends our rooms with the session, and no frame of that session is believed after it."""
        self._owed.clear()
        self._overdue.clear()
        self._barriers.clear()
        self._by_nonce.clear()
