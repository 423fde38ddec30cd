"""The codec: a peer's bytes quoted in a ProtocolError are cut before repr(), not after (a 15 MB value cost 190 ms and
75 MB to make a 60-character message)."""

from __future__ import annotations

import tracemalloc

import msgpack
import pytest

from aioembed.errors import ProtocolError
from aioembed.protocol.messages import MAX_FRAME_BYTES, PROTOCOL_VERSION, decode

BIG = b"\x00" * (MAX_FRAME_BYTES - (1 << 20))


@pytest.mark.parametrize("body", [
    {"type": BIG, "v": PROTOCOL_VERSION},
    {"type": "STATUS", "v": PROTOCOL_VERSION, "room": [BIG, True]},
    {"type": "PING", "v": PROTOCOL_VERSION, "nonce": 1, BIG: 1},
], ids=["type", "room-part", "extra-field-name"])
def test_quoting_a_wide_bytes_value_costs_no_more_than_the_frame(body: dict[object, object]) -> None:
    frame = msgpack.packb(body, use_bin_type=True)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            decode(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(str(info.value)) < 2000
    # decoding holds the frame's bytes once (15 MB); repr() of them built a 60 MB string on the loop, to keep 60 chars
    assert peak < 2 * len(BIG), f"peak {peak / 2**20:.0f} MB quoting a {len(BIG) / 2**20:.0f} MB bytes value"
