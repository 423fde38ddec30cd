"""The small two-sided protocol that carries ``Link.write`` over UCX tag messages.

Every message travels on one UCX endpoint (one per link) with a tag that ucxx mixes with the
endpoint's own tag, so links never see each other's messages. Tags are tuples of ints, whose
``hash()`` is the same in every process (strings would not be: hash randomisation).

A write ``wid`` on a link, writer -> owner unless marked <-:

1. ``PREFIX`` (tag ``(0, 0, 0)``, fixed size): magic, version, kind, ``wid``, body length.
2. ``BODY`` (tag ``(1, wid, 0)``): ``n_direct``, ``n_inline``, then ``(dst, length)`` per op, u64 LE.
3. <- ``REPLY`` (tag ``(2, wid, 0)``): the owner checked every destination against its
   registered memory and posted one receive per direct op straight into that memory
   (``OK``), or refused the whole write (``REFUSED`` + reason) having received nothing.
4. ``DATA`` (tag ``(3, wid, i)``): the bytes of direct op ``i``; then, if ``n_inline``, one
   message (tag ``(3, wid, n_direct)``) with the inline ops' bytes back to back, which the owner
   copies into place (small ops only: one message instead of many).
5. <- ``ACK`` (tag ``(4, wid, 0)``): every byte has landed (``OK``) or why not.

Kind ``EAGER`` is the same write without step 3: the writer sends ``PREFIX``, ``BODY`` and every
``DATA`` message at once and waits only for the ``ACK``, one round trip instead of two. The owner
still checks every destination before it posts a receive into its memory; data that arrives first
waits inside UCX (a rendezvous request, or a small eager message UCX buffers). If it refuses, it
receives the data into scratch buffers, drops it, and answers ``REFUSED`` in the ``ACK``. The writer
uses it only for CPU-to-CPU writes of at most the owner's announced ``eager`` bytes (its descriptor),
which bounds that scratch memory; a larger one is a protocol error that ends the connection.

Kind ``HELLO`` (wid 0) checks, once per UCX endpoint, that the listener is the endpoint the
descriptor named (not another process that reused the port); its body is msgpack.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = [
    "BODY_HEAD",
    "FAILED",
    "KIND_EAGER",
    "KIND_HELLO",
    "KIND_WRITE",
    "MAGIC",
    "MAX_BODY",
    "OK",
    "PREFIX",
    "REFUSED",
    "REPLY",
    "REPLY_SIZE",
    "VERSION",
    "decode_ops",
    "decode_reply",
    "encode_ops",
    "encode_reply",
    "t_ack",
    "t_body",
    "t_data",
    "t_reply",
    "T_PREFIX",
    "TooManyOps",
]

MAGIC = b"AEUX"
VERSION = 1
KIND_HELLO = 1
KIND_WRITE = 2
KIND_EAGER = 3

PREFIX = struct.Struct("<4sHHQQ")  # magic, version, kind, wid, body length
BODY_HEAD = struct.Struct("<II")  # n_direct, n_inline
REPLY = struct.Struct("<II")  # status, message length
REPLY_SIZE = 2048
MAX_BODY = 64 << 20  # 4 Mi ops; a larger body is a protocol error

OK = 0
REFUSED = 1
FAILED = 2

T_PREFIX = (0, 0, 0)


def t_body(wid: int) -> tuple[int, int, int]:
    return (1, wid, 0)


def t_reply(wid: int) -> tuple[int, int, int]:
    return (2, wid, 0)


def t_data(wid: int, i: int) -> tuple[int, int, int]:
    return (3, wid, i)


def t_ack(wid: int) -> tuple[int, int, int]:
    return (4, wid, 0)


def encode_ops(direct: Sequence[tuple[int, int]], inline: Sequence[tuple[int, int]]) -> bytes:
    flat = [v for span in (*direct, *inline) for v in span]
    return BODY_HEAD.pack(len(direct), len(inline)) + struct.pack(f"<{len(flat)}Q", *flat)


class TooManyOps(ValueError):
    """A write body announcing more ops than the owner lets a write have."""


def decode_ops(body: bytes | bytearray, max_ops: int | None = None,
               ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(direct, inline)`` lists of ``(dst, length)``; ``ValueError`` on a malformed body, or one announcing more
    than ``max_ops`` ops, checked before any is unpacked: a 64 MiB body decodes into 4 Mi tuples (~370 MiB)."""
    if len(body) < BODY_HEAD.size:
        raise ValueError(f"write body of {len(body)} bytes is shorter than its head")
    n_direct, n_inline = BODY_HEAD.unpack_from(body)
    n = n_direct + n_inline
    if len(body) != BODY_HEAD.size + 16 * n:
        raise ValueError(f"write body of {len(body)} bytes does not hold {n} ops")
    if max_ops is not None and n > max_ops:
        raise TooManyOps(f"write body announces {n} ops, more than {max_ops}")
    flat = struct.unpack_from(f"<{2 * n}Q", body, BODY_HEAD.size)
    spans = list(zip(flat[0::2], flat[1::2], strict=True))
    return spans[:n_direct], spans[n_direct:]


def encode_reply(status: int, message: str = "") -> bytes:
    raw = message.encode("utf-8", "replace")[: REPLY_SIZE - REPLY.size]
    return REPLY.pack(status, len(raw)) + raw


def decode_reply(buf: bytes | bytearray) -> tuple[int, str]:
    status, n = REPLY.unpack_from(buf)
    if n > len(buf) - REPLY.size:
        raise ValueError(f"reply claims a {n}-byte message")
    return status, bytes(buf[REPLY.size:REPLY.size + n]).decode("utf-8", "replace")
