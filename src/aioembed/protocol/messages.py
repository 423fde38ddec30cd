"""Control-plane messages and their msgpack codec. Sans-IO: bytes in, objects out.

Every frame is a msgpack map with an explicit ``type`` tag and the protocol version ``v``.
:func:`decode` validates every field's type and range, so *any* byte string yields either a
message or a :class:`~aioembed.errors.ProtocolError` (never another exception). Semantic
checks that need context (block ids against the pool size, rounds against the room state)
belong to the room state machines.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import msgpack

from aioembed.errors import ProtocolError

__all__ = [
    "MAX_BLOCKS_PER_MESSAGE",
    "MAX_FRAME_BYTES",
    "MAX_HELLO_BYTES",
    "MAX_INLINE_BYTES",
    "MAX_PARTS",
    "PROTOCOL_VERSION",
    "Abort",
    "AbortAck",
    "Drained",
    "FenceRelease",
    "Hello",
    "Init",
    "Message",
    "Ping",
    "Pong",
    "Progress",
    "Reject",
    "Resume",
    "RoomId",
    "Status",
    "Total",
    "TransferStatus",
    "Welcome",
    "check_metadata",
    "decode",
    "plain_text",
    "encode",
    "validate_room",
]

PROTOCOL_VERSION = 5
"""2: session epochs in HELLO/WELCOME, FENCE_RELEASE and DRAINED (block ownership). 3: a ZeroMQ message
may bundle several frames, one message each (:mod:`aioembed.control.channel`). 4: TOTAL, and a RESUME
accepted while the round before it is being written (the next round announced early). 5: a round's small
fields carried inside its STATUS (``HELLO.status_inline_bytes``, ``STATUS.inline``), and ``REJECT(code="busy")``
to a HELLO beyond the sender's ``max_concurrent_handshakes`` (both unreleased before 5: a peer of 5 knows them)."""
MAX_FRAME_BYTES = 16 << 20
"""Upper bound of any control frame (sockets refuse larger ones before decoding)."""
MAX_BLOCK_SIZE = 1 << 20
"""The largest ``block_size`` a HELLO carries."""
MAX_POOL_BLOCKS = 1 << 32
"""The most blocks a HELLO may announce."""
MAX_INLINE_BYTES = 1 << 20
"""The most bytes of rows one STATUS may carry inline (the ``status_inline_bytes`` setting may not exceed it)."""
MAX_METADATA_BYTES = MAX_FRAME_BYTES - MAX_INLINE_BYTES - (64 << 10)
"""The most metadata one room may carry: it travels inside a STATUS frame, with room for the rows that frame
may carry inline and its other fields (``max_metadata_bytes`` may not exceed it)."""
MAX_BLOCKS_PER_MESSAGE = 1 << 20
MAX_TOKENS = 1 << 40
MAX_ROOM_STR = 256
MAX_TEXT = 4096
MAX_DESCRIPTOR = 1 << 20
MAX_HELLO_BYTES = MAX_DESCRIPTOR + (64 << 10)
"""The largest HELLO frame: its transport descriptor, 256 regions and a few short strings. A peer without a
session may send only HELLO or PING, so a larger frame from one is refused unread (decoding and checking a
valid 5 MB INIT takes about 0.1 s of the event loop)."""
MAX_METADATA_DEPTH = 16

RoomId: TypeAlias = int | str | tuple[int | str, int]
"""A room id (int or str), or on the wire a part of a room: ``(room id, part index)``."""

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class _BoundedRepr(reprlib.Repr):
    """``reprlib.Repr`` cuts a str before quoting it, but quotes bytes whole and then cuts the text (``repr_instance``):
    a 15 MB bytes value built a 60 MB string on the event loop, 14x the cost of decoding the frame."""

    def repr_bytes(self, x: bytes, level: int) -> str:
        if len(x) <= self.maxother:
            return repr(x)
        return f"{x[:self.maxother]!r}... ({len(x)} bytes)"


_QUOTE = _BoundedRepr()
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxtuple, _QUOTE.maxdict = 3, 4, 4, 4
_QUOTE.maxstring, _QUOTE.maxother = 60, 60


_EXTRA_NAMED = 8
"""Unexpected field names quoted in an error (a 14 MB frame of 1.5 M keys gave a 17 MB message)."""


def _quote(v: Any) -> str:
    """A short repr of a value a peer sent, for an error message: bounded in depth and width (``repr()`` of a
    1 KB frame's deeply nested list raised ``RecursionError``; of a wide one, cost more than decoding it)."""
    return _QUOTE.repr(v)



class TransferStatus(enum.StrEnum):
    """Where a room stands. The last three are terminal. A ``str`` enum: it goes on the wire as its
    name, and compares equal to it."""

    BOOTSTRAPPING = "BOOTSTRAPPING"
    WAITING_FOR_INPUT = "WAITING_FOR_INPUT"
    TRANSFERRING = "TRANSFERRING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    ABORTED = "ABORTED"

    @property
    def terminal(self) -> bool:
        """True for SUCCESS, FAILED and ABORTED."""
        return self in _TERMINAL


_TERMINAL = frozenset({TransferStatus.SUCCESS, TransferStatus.FAILED, TransferStatus.ABORTED})
_STATE_NAMES = frozenset(m.value for m in TransferStatus)


# -- field validators -----------------------------------------------------------------------

Validator: TypeAlias = Callable[[str, Any], Any]


def _int(lo: int, hi: int) -> Validator:
    def check(name: str, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise ProtocolError(f"field {name!r}: expected int, got {type(v).__name__}")
        if not lo <= v <= hi:
            raise ProtocolError(f"field {name!r}: {v} out of range [{lo}, {hi}]")
        return v

    return check


def _str(max_len: int, *, choices: tuple[str, ...] | None = None) -> Validator:
    def check(name: str, v: Any) -> str:
        if not isinstance(v, str):
            raise ProtocolError(f"field {name!r}: expected str, got {type(v).__name__}")
        if len(v) > max_len:
            raise ProtocolError(f"field {name!r}: {len(v)} characters, at most {max_len} allowed")
        if choices is not None and v not in choices:
            raise ProtocolError(f"field {name!r}: {v!r} is not one of {choices}")
        return v

    return check


def _bytes(max_len: int) -> Validator:
    def check(name: str, v: Any) -> bytes:
        if not isinstance(v, bytes):
            raise ProtocolError(f"field {name!r}: expected bytes, got {type(v).__name__}")
        if len(v) > max_len:
            raise ProtocolError(f"field {name!r}: {len(v)} bytes, at most {max_len} allowed")
        return v

    return check


def _optional(inner: Validator) -> Validator:
    def check(name: str, v: Any) -> Any:
        return None if v is None else inner(name, v)

    return check


def _block_list(name: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise ProtocolError(f"field {name!r}: expected a list of block ids, got {type(v).__name__}")
    if len(v) > MAX_BLOCKS_PER_MESSAGE:
        raise ProtocolError(f"field {name!r}: {len(v)} block ids, at most {MAX_BLOCKS_PER_MESSAGE}")
    for b in v:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < (1 << 32):
            raise ProtocolError(f"field {name!r}: block id {_quote(b)} is not an int in [0, 2**32)")
    if len(set(v)) != len(v):
        raise ProtocolError(f"field {name!r}: duplicate block ids")
    return tuple(v)


MAX_PARTS = 4096
"""Most parts one room may be assembled from."""


def _plain_room(name: str, v: Any) -> int | str:
    if isinstance(v, bool):
        raise ProtocolError(f"field {name!r}: room id must be int or str, got bool")
    if isinstance(v, int):
        if not _INT64_MIN <= v <= _INT64_MAX:
            raise ProtocolError(f"field {name!r}: room id {v} does not fit in 64 bits")
        return v
    if isinstance(v, str):
        if not 0 < len(v) <= MAX_ROOM_STR:
            raise ProtocolError(f"field {name!r}: room id must have 1..{MAX_ROOM_STR} characters")
        return v
    raise ProtocolError(f"field {name!r}: room id must be int or str, got {type(v).__name__}")


def validate_room(name: str, v: Any) -> RoomId:
    """A room id is a 64-bit signed int or a non-empty str of at most 256 characters; on the wire,
    part ``p`` of a room assembled from parts is ``[room, p]`` (a tuple here)."""
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or isinstance(v[1], bool) or not isinstance(v[1], int) or not 0 <= v[1] < MAX_PARTS:
            raise ProtocolError(f"field {name!r}: a room part must be [room id, part index in "
                                f"0..{MAX_PARTS - 1}], got {_quote(v)}")
        return (_plain_room(name, v[0]), v[1])
    return _plain_room(name, v)


def _check_plain(v: Any, depth: int) -> None:
    if depth > MAX_METADATA_DEPTH:
        raise ProtocolError(f"metadata nested deeper than {MAX_METADATA_DEPTH}")
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return
    if isinstance(v, (list, tuple)):
        for x in v:
            _check_plain(x, depth + 1)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ProtocolError(f"metadata keys must be str, got {type(k).__name__}")
            _check_plain(x, depth + 1)
        return
    raise ProtocolError(f"metadata holds a {type(v).__name__}, which msgpack cannot carry plainly")


def _metadata(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProtocolError(f"field {name!r}: metadata must be a map, got {type(v).__name__}")
    _check_plain(v, 0)
    return v


def plain_text(text: object, limit: int = MAX_TEXT) -> str:
    """``text`` as a reason or error field can always carry it: valid UTF-8, at most ``limit`` characters
    (exception messages from native engines may hold anything)."""
    return str(text).encode("utf-8", "replace").decode("utf-8")[:limit]


def check_metadata(metadata: Any, max_bytes: int) -> int:
    """Apply the codec's own metadata rules; returns the encoded size in bytes.

    The one check used by ``send()`` (before any row moves) and by the codec, so that metadata a
    sender accepts can never fail later inside a STATUS frame. Raises ``ProtocolError`` naming
    the rule: a map with str keys, plain msgpack values, nesting at most 16 deep, at most
    ``max_bytes`` encoded.
    """
    _metadata("metadata", metadata)
    try:
        size = len(msgpack.packb(metadata, use_bin_type=True))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"metadata cannot be encoded: {exc}") from None
    if size > max_bytes:
        raise ProtocolError(f"metadata is {size} bytes encoded; at most {max_bytes} allowed")
    return size


_ROOM = validate_room
_TOKENS = _int(0, MAX_TOKENS)
_ROUND = _int(0, 1 << 31)
_RANK = _int(0, 1 << 16)
_WORLD = _int(1, 1 << 16)


# -- messages -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Base:
    TYPE: ClassVar[str]
    SCHEMA: ClassVar[dict[str, Validator]]

    def to_wire(self) -> bytes:
        """msgpack bytes of this message, with ``type`` and ``v`` tags."""
        return encode(self)

    @classmethod
    def from_wire(cls, data: bytes) -> Message:
        """Decode ``data``; raises ``ProtocolError`` unless it is a valid message of this type."""
        msg = decode(data)
        if not isinstance(msg, cls):
            raise ProtocolError(f"expected a {cls.TYPE} message, got {msg.TYPE}", room=getattr(msg, "room", None))
        return msg


@dataclass(frozen=True, slots=True)
class Hello(_Base):
    """Receiver -> sender: who I am, what I hold, and where to write."""

    TYPE: ClassVar[str] = "HELLO"
    receiver_id: str
    """Stable for the life of the receiver object: the sender keys its drain accounting by it."""
    epoch: int
    """This session's number, increasing per handshake: a write announced in a session is owned by
    (sender, epoch), and ``DRAINED`` confirms the end of earlier epochs' writes."""
    fingerprint: str
    transport: str
    descriptor: bytes
    block_size: int
    num_blocks: int
    rank: int
    world: int
    regions: tuple[tuple[int, int], ...]
    """Per layout field: (base address, length) of the pool tensor in the receiver."""
    status_inline_bytes: int = 0
    """The most bytes of rows this receiver takes inside one STATUS (``Status.inline``); 0: none (a pool
    not in CPU memory, or ``status_inline_bytes = 0``)."""


@dataclass(frozen=True, slots=True)
class Welcome(_Base):
    """Sender -> receiver: handshake accepted."""

    TYPE: ClassVar[str] = "WELCOME"
    sender_id: str
    """The sender process's id; a different one at the same address means the old one is gone."""
    epoch: int
    """The HELLO epoch this answers."""
    heartbeat_interval: float
    writer_id: str = ""
    """The sender's transport identity, for ``Transport.revoke`` on the receiver ("" if none)."""


@dataclass(frozen=True, slots=True)
class Reject(_Base):
    """Either way: a frame or a peer is refused; ``room`` set when one room is concerned."""

    TYPE: ClassVar[str] = "REJECT"
    reason: str
    room: RoomId | None = None
    code: str = "refused"
    """Why, for machines: ``bad_frame``, ``unknown_peer`` (say HELLO first), ``incompatible``
    (handshake refused), ``refused`` (a room-level refusal, or a connect that failed: say HELLO again),
    ``busy`` (a HELLO while the sender has ``max_concurrent_handshakes`` under way: say HELLO again after
    the usual back-off; never final)."""


@dataclass(frozen=True, slots=True)
class Init(_Base):
    """Receiver -> sender: a room's first reservation."""

    TYPE: ClassVar[str] = "INIT"
    room: RoomId
    blocks: tuple[int, ...]
    allocated_tokens: int
    expected_ranks: int
    progress_tokens: int = 0
    """A streaming receiver: announce rows within a round (``PROGRESS``) every this many tokens, a
    multiple of the block size (0: only at the end of each round)."""
    exact_tokens: int = 0
    """A part of a room the receiver assembles from several senders: the part is exactly this many tokens,
    and a ``send()`` of another length fails (it would otherwise succeed on the sender while the receiver
    fails the room). 0: any length."""


@dataclass(frozen=True, slots=True)
class Resume(_Base):
    """Receiver -> sender: round ``round`` of a room, with fresh blocks for the rest."""

    TYPE: ClassVar[str] = "RESUME"
    room: RoomId
    round: int
    sent_tokens: int
    blocks: tuple[int, ...]
    allocated_tokens: int


@dataclass(frozen=True, slots=True)
class Status(_Base):
    """Sender -> receiver: the data of a round is in place (or the room failed)."""

    TYPE: ClassVar[str] = "STATUS"
    room: RoomId
    state: TransferStatus
    total_tokens: int
    sent_tokens: int
    round: int
    metadata: dict[str, Any] | None = None
    error: str | None = None
    fence: bool = False
    """With FAILED: a failed write may still land, so the receiver keeps the blocks fenced until
    the sender's ``FENCE_RELEASE`` (or ``DRAINED``) says it can no longer land."""
    inline: tuple[tuple[int, bytes], ...] = dataclasses.field(default=(), repr=False)
    """With data: ``(field index, bytes)`` per layout field whose rows this frame brings itself instead of a
    write (every row it announces, packed), in field order; at most ``HELLO.status_inline_bytes`` in all."""

    def __post_init__(self) -> None:
        # A state given by name becomes the enum member; an unknown one is refused by encode().
        if not isinstance(self.state, TransferStatus) and self.state in _STATE_NAMES:
            object.__setattr__(self, "state", TransferStatus(self.state))


@dataclass(frozen=True, slots=True)
class Progress(_Base):
    """Sender -> receiver, only to a room that asked for it (``INIT.progress_tokens``): within round
    ``round``, the rows up to ``sent_tokens`` are in place (their write returned, so they are visible)
    and no write of this round reaches their blocks again. Always block-aligned within the round and
    short of its end: the round's last rows come with its ``STATUS``."""

    TYPE: ClassVar[str] = "PROGRESS"
    room: RoomId
    round: int
    sent_tokens: int
    total_tokens: int
    metadata: dict[str, Any] | None = None
    """The room's metadata, on the sender's first announcement to the rank (PROGRESS or STATUS)."""


@dataclass(frozen=True, slots=True)
class Total(_Base):
    """Sender -> receiver: the room is ``total_tokens`` long, more than the rank's first reservation holds.
    Sent once per rank, as round 0's write starts: the receiver may then reserve round 1 and send its RESUME
    while round 0 is still being written, so that the sender writes round 1 as soon as round 0 ended (instead
    of a control round trip later)."""

    TYPE: ClassVar[str] = "TOTAL"
    room: RoomId
    total_tokens: int


@dataclass(frozen=True, slots=True)
class Abort(_Base):
    """Either way: end the room; the receiver of it answers ``ABORT_ACK`` once no write is in flight."""

    TYPE: ClassVar[str] = "ABORT"
    room: RoomId
    reason: str


@dataclass(frozen=True, slots=True)
class AbortAck(_Base):
    """Answer to ``ABORT``: no write into the room's blocks is, or will be, in flight."""

    TYPE: ClassVar[str] = "ABORT_ACK"
    room: RoomId


@dataclass(frozen=True, slots=True)
class FenceRelease(_Base):
    """Sender -> receiver: a failed write into the room's blocks can no longer land (its transport's
    write lifetime has passed); the blocks fenced by ``STATUS(fence=True)`` may be reused."""

    TYPE: ClassVar[str] = "FENCE_RELEASE"
    room: RoomId


@dataclass(frozen=True, slots=True)
class Drained(_Base):
    """Sender -> receiver, in a later session: no write of this sender into memory announced in
    any of the receiver's sessions numbered below ``below_epoch`` is, or will be, in flight."""

    TYPE: ClassVar[str] = "DRAINED"
    below_epoch: int


@dataclass(frozen=True, slots=True)
class Ping(_Base):
    """Heartbeat."""

    TYPE: ClassVar[str] = "PING"
    nonce: int


@dataclass(frozen=True, slots=True)
class Pong(_Base):
    """Heartbeat answer; ``peer_id`` tells a restarted peer from the old one."""

    TYPE: ClassVar[str] = "PONG"
    nonce: int
    peer_id: str
    epoch: int = 0
    """From a sender: the receiver session it knows on this socket (0: none, so the receiver
    learns at its next heartbeat that its session was dropped)."""


def _regions(name: str, v: Any) -> tuple[tuple[int, int], ...]:
    if not isinstance(v, (list, tuple)) or not 1 <= len(v) <= 256:
        raise ProtocolError(f"field {name!r}: expected a list of 1..256 [address, length] pairs")
    out = []
    for item in v:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < (1 << 64) for x in item)):
            raise ProtocolError(f"field {name!r}: bad region {_quote(item)}, expected [address, length]")
        out.append((int(item[0]), int(item[1])))
    return tuple(out)


def _describe(item: Any) -> str:
    """A short account of a bad inline entry: its parts' types, and an int shown (the bytes may be a megabyte)."""
    if not isinstance(item, (list, tuple)):
        return type(item).__name__
    parts = [repr(x) if isinstance(x, int) else type(x).__name__ for x in item[:3]]
    return "[" + ", ".join(parts) + (", ...]" if len(item) > 3 else "]")


def _inline(name: str, v: Any) -> tuple[tuple[int, bytes], ...]:
    if not isinstance(v, (list, tuple)) or len(v) > 256:
        raise ProtocolError(f"field {name!r}: expected a list of at most 256 [field index, bytes] pairs")
    out: list[tuple[int, bytes]] = []
    size = 0
    for item in v:
        if (not isinstance(item, (list, tuple)) or len(item) != 2 or isinstance(item[0], bool)
                or not isinstance(item[0], int) or not 0 <= item[0] < 256 or not isinstance(item[1], bytes)):
            raise ProtocolError(f"field {name!r}: bad entry {_describe(item)}, expected [field index 0..255, bytes]")
        if out and item[0] <= out[-1][0]:
            raise ProtocolError(f"field {name!r}: field indices must increase, got {item[0]} after {out[-1][0]}")
        size += len(item[1])
        out.append((item[0], item[1]))
    if size > MAX_INLINE_BYTES:
        raise ProtocolError(f"field {name!r}: {size} bytes of rows, at most {MAX_INLINE_BYTES}")
    return tuple(out)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"field {name!r}: expected bool, got {type(v).__name__}")
    return v


def _state(name: str, v: Any) -> TransferStatus:
    if isinstance(v, TransferStatus):
        return v
    if not isinstance(v, str):
        raise ProtocolError(f"field {name!r}: expected a state name, got {type(v).__name__}")
    try:
        return TransferStatus(v)
    except ValueError:
        raise ProtocolError(f"field {name!r}: {v[:40]!r} is not one of "
                            f"{[m.value for m in TransferStatus]}") from None


def _seconds(name: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 86400:
        raise ProtocolError(f"field {name!r}: expected seconds in (0, 86400], got {_quote(v)}")
    return float(v)


_EPOCH = _int(1, _INT64_MAX)

Hello.SCHEMA = {
    "receiver_id": _str(64), "epoch": _EPOCH, "fingerprint": _str(128), "transport": _str(64),
    "descriptor": _bytes(MAX_DESCRIPTOR), "block_size": _int(1, MAX_BLOCK_SIZE),
    "num_blocks": _int(1, MAX_POOL_BLOCKS), "rank": _RANK, "world": _WORLD, "regions": _regions,
    "status_inline_bytes": _int(0, MAX_INLINE_BYTES),
}
Welcome.SCHEMA = {"sender_id": _str(64), "epoch": _EPOCH, "heartbeat_interval": _seconds,
                  "writer_id": _str(256)}
REJECT_CODES = ("bad_frame", "unknown_peer", "incompatible", "refused", "busy")
Reject.SCHEMA = {"reason": _str(MAX_TEXT), "room": _optional(_ROOM), "code": _str(32, choices=REJECT_CODES)}
Init.SCHEMA = {"room": _ROOM, "blocks": _block_list, "allocated_tokens": _TOKENS, "expected_ranks": _WORLD,
               "progress_tokens": _TOKENS, "exact_tokens": _TOKENS}
Progress.SCHEMA = {"room": _ROOM, "round": _ROUND, "sent_tokens": _TOKENS, "total_tokens": _TOKENS,
                   "metadata": _optional(_metadata)}
Resume.SCHEMA = {
    "room": _ROOM, "round": _ROUND, "sent_tokens": _TOKENS, "blocks": _block_list, "allocated_tokens": _TOKENS,
}
Status.SCHEMA = {
    "room": _ROOM, "state": _state, "total_tokens": _TOKENS, "sent_tokens": _TOKENS,
    "round": _ROUND, "metadata": _optional(_metadata), "error": _optional(_str(MAX_TEXT)), "fence": _bool,
    "inline": _inline,
}
Total.SCHEMA = {"room": _ROOM, "total_tokens": _int(1, MAX_TOKENS)}
Abort.SCHEMA = {"room": _ROOM, "reason": _str(MAX_TEXT)}
AbortAck.SCHEMA = {"room": _ROOM}
FenceRelease.SCHEMA = {"room": _ROOM}
Drained.SCHEMA = {"below_epoch": _EPOCH}
Ping.SCHEMA = {"nonce": _int(0, _INT64_MAX)}
Pong.SCHEMA = {"nonce": _int(0, _INT64_MAX), "peer_id": _str(64), "epoch": _int(0, _INT64_MAX)}

Message: TypeAlias = (
    Hello | Welcome | Reject | Init | Resume | Status | Progress | Total | Abort | AbortAck | FenceRelease | Drained
    | Ping | Pong
)

_TYPES: dict[str, type[_Base]] = {
    cls.TYPE: cls for cls in (Hello, Welcome, Reject, Init, Resume, Status, Progress, Total, Abort, AbortAck,
                              FenceRelease, Drained, Ping, Pong)
}


_FIELDS: dict[type[_Base], tuple[tuple[dataclasses.Field[Any], ...], frozenset[str]]] = {}


def _fields_of(cls: type[_Base]) -> tuple[tuple[dataclasses.Field[Any], ...], frozenset[str]]:
    """The dataclass fields of message class ``cls`` and the keys a frame of it may hold (looked up once:
    every frame is encoded or decoded with them)."""
    known = _FIELDS.get(cls)
    if known is None:
        fields = dataclasses.fields(cls)
        known = _FIELDS[cls] = (fields, frozenset({f.name for f in fields} | {"type", "v"}))
    return known


def encode(msg: Message | _Base) -> bytes:
    """msgpack bytes of ``msg``. Validates the fields first, so a bad value fails here, not at the peer."""
    cls = type(msg)
    body: dict[str, Any] = {"type": cls.TYPE, "v": PROTOCOL_VERSION}
    for f in _fields_of(cls)[0]:
        value = getattr(msg, f.name)
        cls.SCHEMA[f.name](f.name, value)
        body[f.name] = value.value if isinstance(value, enum.Enum) else value
    try:
        data: bytes = msgpack.packb(body, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode {cls.TYPE}: {exc}") from exc
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{cls.TYPE} frame is {len(data)} bytes, at most {MAX_FRAME_BYTES} allowed")
    return data


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack extension type {code} is not allowed in control frames")


def _unpack(data: bytes) -> dict[Any, Any]:
    """The msgpack map of a frame, or ``ProtocolError``."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(data).__name__}")
    if len(data) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types on garbage; all mean "bad frame"
        raise ProtocolError(f"frame is not valid msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(body).__name__}")
    return body


def _message_class(body: dict[Any, Any], room: RoomId | None) -> type[_Base]:
    """The message type a frame claims, checked against the protocol version."""
    mtype = body.get("type")
    cls = _TYPES.get(mtype) if isinstance(mtype, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_quote(mtype)}; known: {sorted(_TYPES)}", room=room)
    version = body.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        err = ProtocolError(
            f"{cls.TYPE}: protocol version {_quote(version)} is not supported (this side speaks {PROTOCOL_VERSION})",
            room=room,
        )
        err.peer_version = version if isinstance(version, int) and not isinstance(version, bool) else -1
        raise err
    return cls


def _fields(cls: type[_Base], body: dict[Any, Any], room: RoomId | None) -> dict[str, Any]:
    """Every field of ``cls`` from ``body``, validated (defaults for omitted optional ones)."""
    fields, allowed = _fields_of(cls)
    extra = body.keys() - allowed
    if extra:
        names = sorted(_quote(k) for k in itertools.islice(extra, _EXTRA_NAMED))
        more = f" and {len(extra) - len(names)} more" if len(extra) > len(names) else ""
        raise ProtocolError(f"{cls.TYPE}: unexpected fields {', '.join(names)}{more}", room=room)
    kwargs: dict[str, Any] = {}
    for f in fields:
        if f.name not in body:
            if f.default is dataclasses.MISSING:
                raise ProtocolError(f"{cls.TYPE}: missing field {f.name!r}", room=room)
            kwargs[f.name] = f.default
            continue
        try:
            kwargs[f.name] = cls.SCHEMA[f.name](f.name, body[f.name])
        except ProtocolError as exc:
            raise ProtocolError(f"{cls.TYPE}: {exc}", room=room) from None
    return kwargs


def decode(data: bytes) -> Message:
    """Parse and validate one frame. Raises only :class:`ProtocolError` (naming the room when it can)."""
    body = _unpack(data)
    try:
        room = validate_room("room", body["room"]) if "room" in body else None
    except ProtocolError:
        room = None
    cls = _message_class(body, room)
    return cls(**_fields(cls, body, room))  # type: ignore[return-value]
