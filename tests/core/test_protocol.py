"""The control-message codec: round trips of every message type, and fuzzing of decode."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aioembed.errors import ProtocolError
from aioembed.protocol import messages as m
from aioembed.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_METADATA_DEPTH,
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    Hello,
    Init,
    Ping,
    Pong,
    Reject,
    Resume,
    Status,
    Welcome,
    decode,
    encode,
)

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
ALL_TYPES = (Hello, Welcome, Reject, Init, Resume, Status, Abort, AbortAck, Ping, Pong, m.FenceRelease, m.Drained,
             m.Progress, m.Total)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROUNDTRIP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies -------------------------------------------------------------------------------

texts = st.text
room_ids = st.one_of(st.integers(INT64_MIN, INT64_MAX), texts(min_size=1, max_size=256))
block_lists = st.lists(st.integers(0, (1 << 32) - 1), unique=True, max_size=40).map(tuple)
tokens = st.integers(0, 1 << 40)
rounds = st.integers(0, 1 << 31)
plain_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT64_MIN, (1 << 64) - 1),
    st.floats(allow_nan=False),
    texts(max_size=20),
    st.binary(max_size=20),
)
metadata_values = st.recursive(
    plain_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
metadata = st.dictionaries(texts(max_size=12), metadata_values, max_size=6)

hellos = st.builds(
    Hello,
    receiver_id=texts(max_size=64),
    epoch=st.integers(1, INT64_MAX),
    fingerprint=texts(max_size=128),
    transport=texts(max_size=64),
    descriptor=st.binary(max_size=200),
    block_size=st.integers(1, 1 << 20),
    num_blocks=st.integers(1, 1 << 32),
    rank=st.integers(0, 1 << 16),
    world=st.integers(1, 1 << 16),
    regions=st.lists(
        st.tuples(st.integers(1, (1 << 64) - 1), st.integers(1, (1 << 64) - 1)), min_size=1, max_size=6
    ).map(tuple),
    status_inline_bytes=st.integers(0, m.MAX_INLINE_BYTES),
)
welcomes = st.builds(
    Welcome, sender_id=texts(max_size=64), epoch=st.integers(1, INT64_MAX),
    heartbeat_interval=st.floats(min_value=1e-6, max_value=86400.0, allow_nan=False),
    writer_id=texts(max_size=256),
)
rejects = st.builds(Reject, reason=texts(max_size=300), room=st.none() | room_ids)
inits = st.builds(Init, room=room_ids, blocks=block_lists, allocated_tokens=tokens,
                  expected_ranks=st.integers(1, 1 << 16), progress_tokens=tokens)
progresses = st.builds(m.Progress, room=room_ids, round=rounds, sent_tokens=tokens, total_tokens=tokens,
                       metadata=st.none() | metadata)
resumes = st.builds(Resume, room=room_ids, round=rounds, sent_tokens=tokens, blocks=block_lists,
                    allocated_tokens=tokens)
statuses = st.builds(
    Status, room=room_ids, state=st.sampled_from(list(m.TransferStatus)), total_tokens=tokens, sent_tokens=tokens,
    round=rounds, metadata=st.none() | metadata, error=st.none() | texts(max_size=300),
    inline=st.dictionaries(st.integers(0, 255), st.binary(max_size=64), max_size=4).map(
        lambda d: tuple(sorted(d.items()))),
)
aborts = st.builds(Abort, room=room_ids, reason=texts(max_size=300))
abort_acks = st.builds(AbortAck, room=room_ids)
pings = st.builds(Ping, nonce=st.integers(0, INT64_MAX))
pongs = st.builds(Pong, nonce=st.integers(0, INT64_MAX), peer_id=texts(max_size=64), epoch=st.integers(0, INT64_MAX))
fence_releases = st.builds(m.FenceRelease, room=room_ids)
drains = st.builds(m.Drained, below_epoch=st.integers(1, INT64_MAX))
totals = st.builds(m.Total, room=room_ids, total_tokens=st.integers(1, 1 << 40))
STRATEGIES = {
    Hello: hellos, Welcome: welcomes, Reject: rejects, Init: inits, Resume: resumes, Status: statuses,
    Abort: aborts, AbortAck: abort_acks, Ping: pings, Pong: pongs, m.FenceRelease: fence_releases,
    m.Drained: drains, m.Progress: progresses, m.Total: totals,
}
messages = st.one_of(*STRATEGIES.values())


def body_of(msg: Any) -> dict[str, Any]:
    """The msgpack map of a valid message, as a Python dict we can tamper with."""
    body = msgpack.unpackb(encode(msg), raw=False)
    assert isinstance(body, dict)
    return body


def pack(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def decode_or_protocol_error(data: Any) -> Any:
    """decode(data); any exception other than ProtocolError fails the test."""
    try:
        return decode(data)
    except Exception as exc:
        assert isinstance(exc, ProtocolError), f"decode raised {type(exc).__name__}: {exc}"
        return exc


def expect_protocol_error(data: Any) -> ProtocolError:
    out = decode_or_protocol_error(data)
    assert isinstance(out, ProtocolError), f"decode accepted a bad frame as {out!r}"
    return out


SAMPLES: list[Any] = [
    Hello(receiver_id="r0", epoch=3, fingerprint="v1-abc", transport="loopback", descriptor=b"\x00\x01", block_size=128,
          num_blocks=64, rank=0, world=2, regions=((4096, 8192), (1 << 40, 1 << 20))),
    Welcome(sender_id="s0", epoch=3, heartbeat_interval=1.5, writer_id="w"),
    Reject(reason="bad layout", room=None),
    Reject(reason="bad block", room="req-1"),
    Init(room=7, blocks=(3, 1, 2), allocated_tokens=300, expected_ranks=2),
    Resume(room="req-2", round=1, sent_tokens=8192, blocks=(9, 4), allocated_tokens=200),
    Status(room=-5, state="SUCCESS", total_tokens=10, sent_tokens=10, round=0,
           metadata={"grid": [1, 2, [3, 4.5]], "ok": True, "raw": b"\xff", "nested": {"a": None}}),
    Status(room="x", state="FAILED", total_tokens=0, sent_tokens=0, round=0, error="boom"),
    Abort(room=INT64_MAX, reason="client went away"),
    AbortAck(room=INT64_MIN),
    Ping(nonce=0),
    Pong(nonce=INT64_MAX, peer_id="p"),
    m.FenceRelease(room="r"),
    m.Drained(below_epoch=7),
    m.Progress(room=("req", 2), round=1, sent_tokens=8320, total_tokens=20000, metadata={"grid": [1, 2]}),
    Init(room=8, blocks=(1,), allocated_tokens=100, expected_ranks=1, progress_tokens=2048),
    m.Total(room=("req", 0), total_tokens=20000),
]
SAMPLE_IDS = [f"{type(s).__name__}-{i}" for i, s in enumerate(SAMPLES)]


# -- round trips ------------------------------------------------------------------------------


def test_every_type_has_a_sample_and_a_strategy() -> None:
    assert {type(s) for s in SAMPLES} == set(ALL_TYPES) == set(STRATEGIES)
    assert set(m._TYPES.values()) == set(ALL_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=SAMPLE_IDS)
def test_sample_round_trip(msg: Any) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    assert msg.to_wire() == data
    assert decode(data) == msg
    assert decode(bytearray(data)) == msg
    assert decode(memoryview(data)) == msg
    assert type(msg).from_wire(data) == msg
    body = msgpack.unpackb(data, raw=False)
    assert body["type"] == type(msg).TYPE
    assert body["v"] == PROTOCOL_VERSION


@pytest.mark.parametrize("cls", ALL_TYPES, ids=[c.TYPE for c in ALL_TYPES])
@ROUNDTRIP
@given(data=st.data())
def test_round_trip_generated(cls: Any, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[cls])
    wire = msg.to_wire()
    assert len(wire) <= MAX_FRAME_BYTES
    back = cls.from_wire(wire)
    assert back == msg
    assert type(back) is cls
    # decoding is canonical: re-encoding gives the same bytes
    assert encode(back) == wire


@given(msg=messages)
@settings(max_examples=60, deadline=None)
def test_from_wire_of_other_type_refused(msg: Any) -> None:
    other = Ping if not isinstance(msg, Ping) else Pong
    with pytest.raises(ProtocolError) as info:
        other.from_wire(msg.to_wire())
    assert info.value.room == getattr(msg, "room", None)


def test_room_id_edges_round_trip() -> None:
    for room in (0, -1, INT64_MIN, INT64_MAX, "a", "x" * 256, "é漢字🙂", " "):
        msg = AbortAck(room=room)
        assert decode(encode(msg)) == msg


# -- encode refuses invalid values ------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Init(room=1, blocks=(1, 1), allocated_tokens=1, expected_ranks=1),
        lambda: Init(room=1, blocks=(-1,), allocated_tokens=1, expected_ranks=1),
        lambda: Init(room=1, blocks=(1 << 32,), allocated_tokens=1, expected_ranks=1),
        lambda: Init(room=1, blocks=(1,), allocated_tokens=1, expected_ranks=0),
        lambda: Init(room=True, blocks=(1,), allocated_tokens=1, expected_ranks=1),
        lambda: Init(room="", blocks=(1,), allocated_tokens=1, expected_ranks=1),
        lambda: Init(room="x" * 257, blocks=(1,), allocated_tokens=1, expected_ranks=1),
        lambda: Init(room=1 << 63, blocks=(1,), allocated_tokens=1, expected_ranks=1),
        lambda: Init(room=1.5, blocks=(1,), allocated_tokens=1, expected_ranks=1),
        lambda: Resume(room=1, round=-1, sent_tokens=0, blocks=(), allocated_tokens=0),
        lambda: Resume(room=1, round=0, sent_tokens=(1 << 40) + 1, blocks=(), allocated_tokens=0),
        lambda: Status(room=1, state="DONE", total_tokens=1, sent_tokens=1, round=0),
        lambda: Status(room=1, state="SUCCESS", total_tokens=1, sent_tokens=1, round=0, metadata={1: 2}),
        lambda: Status(room=1, state="SUCCESS", total_tokens=1, sent_tokens=1, round=0, metadata={"s": {1, 2}}),
        lambda: Status(room=1, state="SUCCESS", total_tokens=1, sent_tokens=1, round=0, metadata=[1]),
        lambda: Status(room=1, state="SUCCESS", total_tokens=1, sent_tokens=1, round=0, metadata={"i": 1 << 64}),
        lambda: Status(room=1, state="SUCCESS", total_tokens=1, sent_tokens=1, round=0, metadata={"x": object()}),
        lambda: Welcome(sender_id="p", epoch=1, heartbeat_interval=0),
        lambda: Welcome(sender_id="p", epoch=1, heartbeat_interval=float("nan")),
        lambda: Welcome(sender_id="p", epoch=1, heartbeat_interval=float("inf")),
        lambda: Hello(receiver_id="p", epoch=1, fingerprint="f", transport="t", descriptor=b"", block_size=1,
                      num_blocks=1, rank=0, world=1, regions=()),
        lambda: Hello(receiver_id="p", epoch=1, fingerprint="f", transport="t", descriptor="str", block_size=1,
                      num_blocks=1, rank=0, world=1, regions=((1, 1),)),
        lambda: Hello(receiver_id="p" * 65, epoch=1, fingerprint="f", transport="t", descriptor=b"", block_size=1,
                      num_blocks=1, rank=0, world=1, regions=((1, 1),)),
        lambda: Hello(receiver_id="p", epoch=1, fingerprint="f", transport="t", descriptor=b"x" * ((1 << 20) + 1),
                      block_size=1, num_blocks=1, rank=0, world=1, regions=((1, 1),)),
        lambda: Ping(nonce=-1),
        lambda: Pong(nonce=1, peer_id=None),
        lambda: Abort(room=1, reason="r" * 4097),
        lambda: Reject(reason="x", room=[1]),
        lambda: AbortAck(room="\ud800"),  # a lone surrogate cannot be UTF-8 encoded
    ],
)
def test_encode_refuses_invalid_fields(bad: Any) -> None:
    with pytest.raises(ProtocolError):
        encode(bad())


def test_encode_refuses_frame_over_limit() -> None:
    blob = b"x" * (1 << 20)
    huge = Status(room=1, state="SUCCESS", total_tokens=1, sent_tokens=1, round=0,
                  metadata={f"k{i}": blob for i in range(17)})
    with pytest.raises(ProtocolError, match="frame"):
        encode(huge)


# -- decode: fuzzing --------------------------------------------------------------------------


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_only_protocol_error(data: bytes) -> None:
    out = decode_or_protocol_error(data)
    assert isinstance(out, (ProtocolError, *ALL_TYPES))


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", b"\x80", b"\x90", b"\xa3abc", b"\x01", b"\xc0", b"\xc3", b"\xcb" + b"\x00" * 8,
     b"\x81\xa4type", b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
     pack({"type": "PING", "v": PROTOCOL_VERSION, "nonce": 1}) + b"\x00", b"\x91" * 5000 + b"\x00"],
)
def test_garbage_frames(data: bytes) -> None:
    expect_protocol_error(data)


@pytest.mark.parametrize("data", ["text", None, 12, [b"\x80"], {"type": "PING"}])
def test_non_bytes_input(data: Any) -> None:
    expect_protocol_error(data)


def test_frame_over_limit_refused_before_parsing() -> None:
    expect_protocol_error(b"\x00" * (MAX_FRAME_BYTES + 1))


@FUZZ
@given(msg=messages, data=st.data())
def test_byte_mutations_only_protocol_error(msg: Any, data: st.DataObject) -> None:
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        kind = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]), label="kind")
        pos = data.draw(st.integers(0, max(0, len(frame) - 1)), label="pos")
        if kind == "flip" and frame:
            frame[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and frame:
            frame[pos] = data.draw(st.integers(0, 255))
        elif kind == "insert":
            frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=9))
        elif kind == "delete" and frame:
            del frame[pos:pos + data.draw(st.integers(1, 4))]
        elif kind == "truncate":
            del frame[pos:]
    out = decode_or_protocol_error(bytes(frame))
    if not isinstance(out, ProtocolError):
        # a mutation may still produce a valid frame; it must then be fully valid
        assert isinstance(out, ALL_TYPES)
        assert decode(encode(out)) == out


WRONG_VALUES = st.one_of(
    st.none(), st.booleans(), st.floats(), st.text(max_size=5), st.binary(max_size=5),
    st.lists(st.integers(INT64_MIN, INT64_MAX), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(INT64_MIN, INT64_MAX), max_size=2),
    st.integers(-(1 << 63), (1 << 64) - 1),
)


def _valid_for(cls: Any, name: str, value: Any) -> bool:
    try:
        cls.SCHEMA[name](name, value)
    except ProtocolError:
        return False
    return True


@FUZZ
@given(msg=messages, data=st.data())
def test_structural_mutations_only_protocol_error(msg: Any, data: st.DataObject) -> None:
    cls = type(msg)
    body = body_of(msg)
    fields = [f.name for f in dataclasses.fields(cls)]
    kind = data.draw(st.sampled_from(
        ["drop", "retype", "add", "version", "type", "huge", "drop_type", "drop_version"]), label="kind")
    if kind == "drop":
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        name = data.draw(st.sampled_from(required), label="field")
        del body[name]
        err = expect_protocol_error(pack(body))
        assert name in str(err)
    elif kind == "retype":
        name = data.draw(st.sampled_from(fields), label="field")
        value = data.draw(WRONG_VALUES, label="value")
        assume(not _valid_for(cls, name, value))
        body[name] = value
        err = expect_protocol_error(pack(body))
        assert name in str(err)
    elif kind == "add":
        name = data.draw(st.text(min_size=1, max_size=10), label="name")
        assume(name not in body)
        body[name] = data.draw(WRONG_VALUES, label="value")
        err = expect_protocol_error(pack(body))
        assert "unexpected" in str(err)
    elif kind == "version":
        v = data.draw(st.integers(-(1 << 63), (1 << 64) - 1).filter(lambda x: x != PROTOCOL_VERSION))
        body["v"] = v
        err = expect_protocol_error(pack(body))
        assert err.peer_version == v
        assert err.room == getattr(msg, "room", None)
    elif kind == "type":
        t = data.draw(WRONG_VALUES, label="type")
        assume(not (isinstance(t, str) and t in m._TYPES))
        body["type"] = t
        err = expect_protocol_error(pack(body))
        assert err.room == getattr(msg, "room", None)
    elif kind == "huge":
        ints = [n for n in fields if isinstance(body[n], int) and not isinstance(body[n], bool)]
        assume(ints)
        name = data.draw(st.sampled_from(ints), label="field")
        value = data.draw(st.sampled_from([(1 << 64) - 1, 1 << 63, INT64_MIN, -1, (1 << 40) + 1, 1 << 32]))
        assume(not _valid_for(cls, name, value))
        body[name] = value
        expect_protocol_error(pack(body))
    elif kind == "drop_type":
        del body["type"]
        expect_protocol_error(pack(body))
    else:
        del body["v"]
        err = expect_protocol_error(pack(body))
        assert err.peer_version is not None


# -- decode: specific malformed frames --------------------------------------------------------


def _init_body(**changes: Any) -> dict[str, Any]:
    body = {"type": "INIT", "v": PROTOCOL_VERSION, "room": "req-9", "blocks": [4, 2, 7], "allocated_tokens": 300,
            "expected_ranks": 1}
    body.update(changes)
    return body


def _status_body(**changes: Any) -> dict[str, Any]:
    body = {"type": "STATUS", "v": PROTOCOL_VERSION, "room": 42, "state": "SUCCESS", "total_tokens": 3,
            "sent_tokens": 3, "round": 0, "metadata": {"k": 1}, "error": None}
    body.update(changes)
    return body


def _nested(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (_init_body(blocks=[1, -1]), "blocks"),
        (_init_body(blocks=[1, 2, 1]), "duplicate"),
        (_init_body(blocks=[1, True]), "blocks"),
        (_init_body(blocks=[1, 2.0]), "blocks"),
        (_init_body(blocks=[1 << 32]), "blocks"),
        (_init_body(blocks={"a": 1}), "blocks"),
        (_init_body(blocks="123"), "blocks"),
        (_init_body(allocated_tokens=-1), "allocated_tokens"),
        (_init_body(allocated_tokens=(1 << 64) - 1), "allocated_tokens"),
        (_init_body(allocated_tokens=True), "allocated_tokens"),
        (_init_body(expected_ranks=0), "expected_ranks"),
        (_init_body(extra=1), "unexpected"),
        (_status_body(state="DONE"), "state"),
        (_status_body(metadata=[1, 2]), "metadata"),
        (_status_body(metadata={"a": _nested(MAX_METADATA_DEPTH + 5)}), "deeper"),
        (_status_body(metadata={b"bytes-key": 1}), "keys"),
        (_status_body(metadata={"a": {b"inner": 1}}), "keys"),
        (_status_body(error=5), "error"),
        (_status_body(round=1 << 40), "round"),
    ],
)
def test_bad_fields_name_field_and_carry_room(body: dict[str, Any], fragment: str) -> None:
    err = expect_protocol_error(pack(body))
    assert fragment in str(err)
    assert err.room == body["room"]
    assert err.peer_version is None


def test_metadata_depth_limit_boundary() -> None:
    ok = Status(room=1, state="SUCCESS", total_tokens=1, sent_tokens=1, round=0,
                metadata={"a": _nested(MAX_METADATA_DEPTH - 1)})
    assert decode(encode(ok)) == ok
    deep = _status_body(metadata={"a": _nested(MAX_METADATA_DEPTH)})
    expect_protocol_error(pack(deep))


def test_deeply_nested_frame_is_protocol_error() -> None:
    # deeper than msgpack's own recursion limit
    expect_protocol_error(b"\x81\xa8metadata" + b"\x91" * 100_000 + b"\x01")
    expect_protocol_error(pack(_status_body(metadata={"a": _nested(500)})))


def test_non_str_keys_refused() -> None:
    for body in (
        _status_body(metadata={1: "int key"}),
        {"type": "PING", "v": PROTOCOL_VERSION, "nonce": 1, 5: 5},
        {b"type": "PING", "v": PROTOCOL_VERSION, "nonce": 1},
        {"type": "PING", "v": PROTOCOL_VERSION, "nonce": 1, b"x": 1},
    ):
        data = msgpack.packb(body, use_bin_type=True, strict_types=False)
        expect_protocol_error(data)


def test_ext_types_refused() -> None:
    ext = msgpack.ExtType(5, b"payload")
    for body in (
        _status_body(metadata={"x": ext}),
        _init_body(room=ext),
        _init_body(blocks=[1, ext]),
        {"type": ext, "v": PROTOCOL_VERSION},
        ext,
    ):
        expect_protocol_error(pack(body))
    # msgpack's own timestamp extension (-1) is decoded natively: still not a plain value
    ts = msgpack.Timestamp(1, 0)
    expect_protocol_error(pack(_status_body(metadata={"t": ts})))
    expect_protocol_error(pack(_init_body(room=ts)))
    expect_protocol_error(pack({"type": "WELCOME", "v": PROTOCOL_VERSION, "sender_id": "p", "epoch": 1,
                                "heartbeat_interval": ts}))


@pytest.mark.parametrize("top", [[1, 2], 1, "PING", None, b"x", 1.5, True])
def test_top_level_not_a_map(top: Any) -> None:
    err = expect_protocol_error(pack(top))
    assert err.room is None


@pytest.mark.parametrize("version", [0, 1, -1, 1 << 40, 99])
def test_version_mismatch_sets_peer_version(version: int) -> None:
    body = _init_body(v=version)
    err = expect_protocol_error(pack(body))
    assert err.peer_version == version
    assert err.room == "req-9"
    assert "version" in str(err)


@pytest.mark.parametrize("version", ["1", None, [1], 1.5])
def test_version_of_wrong_type(version: Any) -> None:
    err = expect_protocol_error(pack(_init_body(v=version)))
    assert err.peer_version is not None and err.peer_version != PROTOCOL_VERSION


def test_missing_version_refused() -> None:
    body = _init_body()
    del body["v"]
    err = expect_protocol_error(pack(body))
    assert err.peer_version is not None
    assert err.room == "req-9"


@pytest.mark.parametrize("version", [True, 1.0])
def test_version_must_be_an_int(version: Any) -> None:
    expect_protocol_error(pack({"type": "PING", "v": version, "nonce": 1}))


@pytest.mark.parametrize(
    "tag", ["ping", "HELLO ", "", "UNKNOWN", None, 1, b"PING", ["PING"]],
)
def test_wrong_type_tag(tag: Any) -> None:
    err = expect_protocol_error(pack({"type": tag, "v": PROTOCOL_VERSION, "room": 5, "nonce": 1}))
    assert err.room == 5


@pytest.mark.parametrize("room", ["", "x" * 257, True, 1.5, [1], {"a": 1}, None, 1 << 63, (1 << 64) - 1])
def test_bad_room_no_room_on_error(room: Any) -> None:
    err = expect_protocol_error(pack(_init_body(room=room)))
    assert err.room is None
    assert "room" in str(err)


def test_reject_room_optional() -> None:
    body = {"type": "REJECT", "v": PROTOCOL_VERSION, "reason": "no"}
    assert decode(pack(body)) == Reject(reason="no", room=None)
    body["room"] = "r"
    assert decode(pack(body)) == Reject(reason="no", room="r")


def test_defaults_may_be_omitted_on_the_wire() -> None:
    body = _status_body()
    del body["metadata"]
    del body["error"]
    assert decode(pack(body)) == Status(room=42, state="SUCCESS", total_tokens=3, sent_tokens=3, round=0)


def test_welcome_int_interval_accepted_as_float() -> None:
    msg = decode(pack({"type": "WELCOME", "v": PROTOCOL_VERSION, "sender_id": "p", "epoch": 1,
                       "heartbeat_interval": 2}))
    assert msg == Welcome(sender_id="p", epoch=1, heartbeat_interval=2.0)
    assert isinstance(msg.heartbeat_interval, float)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "regions",
    [[], [[1]], [[1, 2, 3]], [[0, 4]], [[4, 0]], [[True, 4]], [[1.0, 4]], "ab",
     [[1, 1]] * 257],
)
def test_hello_bad_regions(regions: Any) -> None:
    good = body_of(SAMPLES[0])
    good["regions"] = regions
    err = expect_protocol_error(pack(good))
    assert "regions" in str(err)


@pytest.mark.parametrize("total", [0, -1, 1 << 41, True, "8"])
def test_total_needs_a_positive_token_count(total: Any) -> None:
    err = expect_protocol_error(pack({"type": "TOTAL", "v": m.PROTOCOL_VERSION, "room": "r", "total_tokens": total}))
    assert "total_tokens" in str(err) and err.room == "r"
