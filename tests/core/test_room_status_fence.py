"""The room machines: frames whose fields contradict each other are refused, not half-believed."""

from __future__ import annotations

import copy

import pytest

from aioembed.errors import ProtocolError
from aioembed.protocol.messages import Status, TransferStatus, decode, encode
from aioembed.protocol.room import ReceiverRoomState


@pytest.mark.parametrize("state", [TransferStatus.TRANSFERRING, TransferStatus.SUCCESS])
def test_a_data_status_that_also_says_fence_is_refused(state: TransferStatus) -> None:
    """``fence=True`` says a failed write of the room may still land; a data STATUS says the round's writes
    ended. The codec accepts the pair, the live room took it as data (its grant landed, then read and freed),
    while the same frame arriving late fenced the room's blocks (``BlockKeeper.late_fence``). Refused like
    ``inline`` rows on a FAILED STATUS: the room fails, fencing what it announced, and ABORTs."""
    r = ReceiverRoomState("r", block_size=4, max_tokens=100)
    r.init_sent(blocks=2, allocated_tokens=8)
    total = 8 if state is TransferStatus.SUCCESS else 20
    msg = decode(encode(Status(room="r", state=state, total_tokens=total, sent_tokens=8, round=0, fence=True)))
    assert isinstance(msg, Status) and msg.fence
    before = copy.deepcopy(vars(r))
    with pytest.raises(ProtocolError, match="fence") as info:
        r.on_status(msg)
    assert info.value.room == "r"
    assert vars(r) == before
