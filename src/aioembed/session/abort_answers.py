"""The ABORTs a receiver sent one sender, and which answers to them are still owed (sans-IO).

A room id the receiver aborted is not reused until the sender answers that ABORT: the answer would reach
the id's next attempt, and the sender still holds the old one. The sender answers every ABORT with an
ABORT_ACK, or with ``STATUS(fence=True)`` while a write of the room may still land; a REJECT naming the room
never answers it (it refused another frame that crossed the room's end, e.g. a RESUME). When the room's own
fence STATUS crossed the ABORT, that STATUS lets the id go, and the sender, getting the ABORT once the write
can no longer land, answers with an ABORT_ACK too: it may find the id's next attempt, which must ignore it.
"""

from __future__ import annotations

from collections import OrderedDict

from aioembed.protocol.messages import AbortAck, Reject, RoomId, Status

__all__ = ["AbortAnswers"]

_KEPT = 1024
"""Room ids remembered whose ABORT a fence STATUS answered (most never get an ABORT_ACK after it)."""


class AbortAnswers:
    """Per sender connection: the rooms whose ABORT is unanswered (``room in answers``: the id is held)."""

    def __init__(self, kept: int = _KEPT) -> None:
        self._owed: set[RoomId] = set()
        self._fence_answered: OrderedDict[RoomId, None] = OrderedDict()
        self._kept = kept

    def __contains__(self, room: object) -> bool:
        return room in self._owed

    def __len__(self) -> int:
        return len(self._owed)

    def sent(self, room: RoomId) -> None:
        """An ABORT of ``room`` went to the sender."""
        self._owed.add(room)

    def late(self, msg: Status | AbortAck | Reject, room: RoomId) -> None:
        """A frame of the sender for ``room``, which is no longer in flight here."""
        if isinstance(msg, Reject) or (isinstance(msg, Status) and not msg.fence):
            return
        if room in self._owed and isinstance(msg, Status):
            self._fence_answered[room] = None
            self._fence_answered.move_to_end(room)
            while len(self._fence_answered) > self._kept:
                self._fence_answered.popitem(last=False)
        self._owed.discard(room)

    def stale_ack(self, room: RoomId) -> bool:
        """True if an ABORT_ACK for ``room``, which is in flight here again, answers an earlier attempt's
        ABORT (a fence STATUS answered it first); it proves nothing about this attempt's blocks."""
        if room not in self._fence_answered:
            return False
        del self._fence_answered[room]
        return True

    def session_ended(self) -> None:
        """The sender ends our rooms with the session: no answer is owed any more."""
        self._owed.clear()
