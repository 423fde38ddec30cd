"""The codec: whatever bytes a peer sends, decode() raises ProtocolError or returns a message."""

from __future__ import annotations

import time
from typing import Any

import anyio
import msgpack
import pytest

from aioembed import TransferConfig
from aioembed.errors import ProtocolError
from aioembed.protocol.messages import Reject, decode
from tests.faults.rawpeer import raw_receiver
from tests.session.conftest import LAYOUT, running

DEPTH = 1000
"""Nested deep enough for repr() to pass Python's recursion limit, and within msgpack's own (1024 levels): the
frame is about 1 KB, well under the HELLO bound a peer without a session may send."""


def nested(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


HELLO = {"type": "HELLO", "v": 5, "receiver_id": "r", "epoch": 1, "fingerprint": "f", "transport": "t",
         "descriptor": b"", "block_size": 1, "num_blocks": 1, "rank": 0, "world": 1, "regions": [[1, 1]]}


@pytest.mark.parametrize("body", [
    pytest.param({"type": "ABORT", "v": 5, "room": nested(DEPTH), "reason": "x"}, id="room"),
    pytest.param({"type": nested(DEPTH), "v": 5}, id="type"),
    pytest.param({"type": "PING", "v": nested(DEPTH), "nonce": 1}, id="version"),
    pytest.param({"type": "INIT", "v": 5, "room": 1, "blocks": [nested(DEPTH)], "allocated_tokens": 1,
                  "expected_ranks": 1}, id="block id"),
    pytest.param({**HELLO, "regions": [nested(DEPTH)]}, id="region"),
    pytest.param({"type": "WELCOME", "v": 5, "sender_id": "s", "epoch": 1, "heartbeat_interval": nested(DEPTH)},
                 id="seconds"),
])
def test_a_deeply_nested_field_is_a_protocol_error(body: dict[str, Any]) -> None:
    """The error message quoted the bad value with repr(), which raised RecursionError out of decode()
    (the channel then logged a full traceback per frame, unbudgeted, and the sender answered no REJECT)."""
    data = msgpack.packb(body, use_bin_type=True)
    assert len(data) < 2048
    with pytest.raises(ProtocolError):
        decode(data)


def test_a_wide_bad_room_is_refused_without_quoting_it_whole() -> None:
    """A 4 MB list as a room id was repr()'d whole before the message cut it to 80 characters (several times
    the cost of unpacking it, on the event loop)."""
    body = {"type": "ABORT", "v": 5, "room": [None] * (4 << 20), "reason": "x"}
    data = msgpack.packb(body, use_bin_type=True)
    unpack = time.perf_counter()
    msgpack.unpackb(data)
    unpack = time.perf_counter() - unpack
    t = time.perf_counter()
    with pytest.raises(ProtocolError) as info:
        decode(data)
    took = time.perf_counter() - t
    assert len(str(info.value)) < 400
    assert took < 3 * unpack + 0.1, f"decode {took:.3f} s, unpack alone {unpack:.3f} s"


@pytest.mark.anyio
async def test_a_sender_answers_a_deeply_nested_frame_with_a_bad_frame_reject(
        caplog: pytest.LogCaptureFixture) -> None:
    """Like any other bad frame (tests/faults/test_bad_input.py): a REJECT, a budgeted warning. The RecursionError
    went past the sender's ``except ProtocolError``: no answer, and the channel logged an ERROR with its traceback
    for every such frame."""
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=2.0)
    async with running(cfg) as (sender, _), raw_receiver(sender.address, LAYOUT, cfg) as raw:
        for _ in range(3):
            raw.send_raw(msgpack.packb({"type": nested(DEPTH), "v": 5}))
            with anyio.fail_after(5):
                rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and rej.code == "bad_frame"
    assert not [r for r in caplog.records if r.exc_info], "a bad frame's traceback was logged"


def test_unexpected_fields_are_named_up_to_a_bound() -> None:
    """Every extra key was listed: a frame of 1.5 M keys gave a 17 MB error message."""
    body = {"type": "PING", "v": 5, "nonce": 1, **{f"k{i}": 0 for i in range(10000)}}
    with pytest.raises(ProtocolError, match=r"PING: unexpected fields 'k\d+', .* and 9992 more") as info:
        decode(msgpack.packb(body, use_bin_type=True))
    assert len(str(info.value)) < 300
    with pytest.raises(ProtocolError, match=r"unexpected fields 'extra'$"):
        decode(msgpack.packb({"type": "PING", "v": 5, "nonce": 1, "extra": 1}, use_bin_type=True))
