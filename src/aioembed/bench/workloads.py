"""What the benchmark moves: request sizes, concurrency mixes, and a mixed multimodal trace.

The trace generator
-------------------
:func:`generate_trace` draws a seeded, reproducible sequence of requests as a multimodal
serving front end sees them. Each request is, independently:

============  ===========  =========================================================
kind          probability  multimodal tokens
============  ===========  =========================================================
text          0.35         0 (nothing to transfer: the language side skips the room)
image         0.40         one image: uniform integer in [256, 2700]
multi_image   0.15         2..6 images (uniform count), each uniform in [256, 2700]
video         0.10         one short video: uniform integer in [10000, 50000]
============  ===========  =========================================================

The image range matches a Qwen2-VL style encoder (one token per 28 x 28 patch after merging:
a 448 x 448 image gives 256 tokens, about 1456 x 1456 gives 2704); the video range is a few
seconds to a minute of frames at the usual 2 fps sampling. Draws use :class:`random.Random`
seeded with ``seed`` only, so a seed fixes the whole trace on every platform and Python 3.11+.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from aioembed.layout import Layout
from aioembed.session.stream import Chunk

if TYPE_CHECKING:
    from aioembed.session.receiver import EmbeddingReceiver

RECEIVE_MODES = ("copy", "out", "lease")
"""How a benchmark's receiving side takes a room's rows: ``receive()`` into a fresh output, ``receive(out=...)``
into reused buffers (one set per room in flight), ``receive_leased()``. Anything else is refused (a misspelt
mode must not measure another)."""


def check_receive_mode(mode: str) -> str:
    """``mode`` if it is one of :data:`RECEIVE_MODES`; ``ValueError`` naming the known ones otherwise."""
    if mode not in RECEIVE_MODES:
        raise ValueError(f"unknown receive mode {mode!r}; known: {', '.join(RECEIVE_MODES)}")
    return mode


class OutBuffers:
    """The ``out=`` buffers of a benchmark's receiving side: one set per worker (``slot``), reused by its rooms and
    replaced by a larger one when a room needs more rows. Rooms in flight at the same time never share one, so a
    room's check reads the rows that room copied, as a server gives each request in flight its own buffers."""

    def __init__(self, layout: Layout, device: str | torch.device) -> None:
        self.layout = layout
        self.device = device
        self._sets: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._sets)

    def get(self, slot: int, tokens: int) -> dict[str, torch.Tensor]:
        """Worker ``slot``'s buffers, of at least ``tokens`` rows."""
        out = self._sets.get(slot)
        if out is None or next(iter(out.values())).shape[0] < tokens:
            out = self._sets[slot] = self.layout.empty(tokens, device=self.device)
        return out


__all__ = [
    "FULL_CONCURRENCY",
    "FULL_SIZES",
    "IMAGE_TOKENS",
    "MULTI_IMAGE_COUNT",
    "OutBuffers",
    "QUICK_CONCURRENCY",
    "QUICK_SIZES",
    "RECEIVE_MODES",
    "REQUEST_MIXES",
    "ROOM_OFFSETS",
    "TRACE_KINDS",
    "VIDEO_TOKENS",
    "TraceRequest",
    "check_receive_mode",
    "chunk_rows",
    "concurrency_sizes",
    "generate_trace",
    "make_source",
    "room_offset",
    "room_rows",
    "rows_by_offset",
    "take_room",
    "trace_summary",
]

FULL_SIZES: tuple[int, ...] = (16, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536)
QUICK_SIZES: tuple[int, ...] = (16, 1024, 8192, 32768)
FULL_CONCURRENCY: tuple[int, ...] = (1, 4, 16, 64, 256)
QUICK_CONCURRENCY: tuple[int, ...] = (1, 64)

REQUEST_MIXES: dict[str, tuple[int, int]] = {"small": (16, 256), "medium": (1024, 4096)}
"""Per-room request sizes (uniform, inclusive) of the concurrency workload."""

TRACE_KINDS: tuple[tuple[str, float], ...] = (("text", 0.35), ("image", 0.40), ("multi_image", 0.15),
                                              ("video", 0.10))
IMAGE_TOKENS = (256, 2700)
MULTI_IMAGE_COUNT = (2, 6)
VIDEO_TOKENS = (10_000, 50_000)


_TILE_BYTES = 65521
"""The largest prime below 2**16: the period of :func:`make_source`'s bytes."""

def make_source(layout: Layout, num_tokens: int, seed: int = 0,
                device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Source rows for ``num_tokens`` tokens on ``device``, every page touched, cheap to make.

    Contents are pseudo-random bytes from one small random block tiled over the tensor (random
    per byte would cost seconds for 65536 tokens; the copies do not look at the values). The block's
    length is a prime (65521 bytes), so a field's rows do not repeat with a short period (with a power of two, a
    7168-byte row repeated every 64 rows; a 4-byte row may still equal another by chance) and the rows of
    :func:`room_rows` at two offsets differ. They
    do not depend on ``device``, so a checker can regenerate them on whichever device holds the rows it
    checks.
    """
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (_TILE_BYTES,), dtype=torch.uint8, generator=g)
    out: dict[str, torch.Tensor] = {}
    for name, f in layout.items():
        nbytes = num_tokens * f.row_bytes
        raw = block.repeat(-(-nbytes // block.numel()))[:nbytes]
        out[name] = raw.view(f.dtype).reshape(num_tokens, *f.shape).to(device)
    return out


ROOM_OFFSETS = 8
"""A checked room sends rows shifted by one of this many offsets into its source (see :func:`room_rows`): a
source for rooms of up to ``n`` tokens has ``n + ROOM_OFFSETS`` rows. Few, so that a small room's source rows
stay in a core's cache from room to room as the raw baseline's do: with 1024 offsets (64-token rooms spread over
7.8 MB of source) W3 x32 over Mooncake ran 6-11 % slower in each of 4 alternating pairs of runs, from cache
misses in the sender's reads and the receiving side's check."""


def room_offset(room: str) -> int:
    """The row at which ``room``'s rows start in its source (the same on both sides: from the room id)."""
    return zlib.crc32(room.encode()) % ROOM_OFFSETS


def rows_by_offset(source: Mapping[str, torch.Tensor], num_tokens: int) -> list[dict[str, torch.Tensor]]:
    """:func:`room_rows` of ``source`` for each offset, made once: ``rows_by_offset(...)[room_offset(room)]`` is
    ``room``'s. A series of rooms takes its rows from these, so it makes no objects per room beyond what aioembed
    makes: tensor views are objects the garbage collector tracks, and what a series keeps alive while its rooms
    run is promoted towards the full collections (80-90 ms each here) that set W3 x32's p99 when one falls
    inside it."""
    return [_rows_at(source, offset, num_tokens) for offset in range(ROOM_OFFSETS)]


def room_rows(source: Mapping[str, torch.Tensor], room: str, num_tokens: int) -> dict[str, torch.Tensor]:
    """Rows ``[o, o + num_tokens)`` of every field of ``source`` (views), ``o = room_offset(room)``: what the bench
    sends as ``room`` and what the receiving side compares its rows with.

    Every room of a point used to send the same rows, so a pool block that a write never reached still held
    an earlier room's identical rows and passed the bit-for-bit check: a write that landed nowhere would have
    measured as a fast one. Shifted by the room, two rooms' rows are alike only when their offsets are (1 in
    :data:`ROOM_OFFSETS`), so such a write fails its room's check 7 times in 8: a bug that skips writes fails
    the first few rooms it touches."""
    return _rows_at(source, room_offset(room), num_tokens)


def _rows_at(source: Mapping[str, torch.Tensor], offset: int, num_tokens: int) -> dict[str, torch.Tensor]:
    """Rows ``[offset, offset + num_tokens)`` of every field of ``source`` (views)."""
    for name, t in source.items():
        if offset + num_tokens > t.shape[0]:
            raise ValueError(f"rows [{offset}, {offset + num_tokens}) of field {name!r} are past its {t.shape[0]} rows "
                             f"(a source for rooms of {num_tokens} tokens needs {num_tokens} + ROOM_OFFSETS = "
                             f"{num_tokens + ROOM_OFFSETS})")
    return {name: t[offset:offset + num_tokens] for name, t in source.items()}


async def take_room(receiver: EmbeddingReceiver, room: str, mode: str, *, expected: int | None, sender: str | None,
                    out: Mapping[str, torch.Tensor] | None, same: Callable[[Mapping[str, Any]], bool],
                    clock: Callable[[], float], error: type[Exception]) -> tuple[float, int, Callable[[], None]]:
    """The receiving side of one benchmark room, as ``mode`` says (``lease``: ``receive_leased()``, else
    ``receive()``, into ``out`` if given): (``clock()`` once the rows are in hand, rounds, ``finish``).
    ``finish()`` asks ``same`` about the rows (a lease's where they lie in the pool) and lets them go, a lease
    released even if ``same`` raises; rows that differ raise ``error``, naming the room."""

    def differ() -> Exception:
        return error(f"room {room!r}: the rows differ from the source")

    if mode == "lease":
        lease = await receiver.receive_leased(room, expected_tokens=expected, sender=sender)
        t = clock()

        def release() -> None:
            try:
                ok = same(lease.views)
            finally:
                lease.release()
            if not ok:
                raise differ()

        return t, lease.rounds, release
    got = await receiver.receive(room, expected_tokens=expected, sender=sender, out=out)
    t = clock()

    def drop() -> None:
        if not same(got.tensors):
            raise differ()

    return t, got.rounds, drop


def chunk_rows(chunks: Sequence[Chunk]) -> dict[str, list[torch.Tensor]]:
    """The rows of a stream's chunks as pieces per field, in token order, what :func:`~aioembed.samples.same_rows`
    compares with the room's rows. Raises ``ValueError`` unless the chunks cover ``[0, n)`` one after another."""
    fields: dict[str, list[torch.Tensor]] = {}
    at = 0
    for chunk in chunks:
        if chunk.start != at:
            raise ValueError(f"room {chunk.room!r}: a chunk starts at token {chunk.start}, expected {at} (the chunks "
                             "so far end there)")
        at = chunk.end
        for name, t in chunk.tensors.items():
            fields.setdefault(name, []).append(t)
    return fields


def concurrency_sizes(mix: str, count: int, seed: int) -> list[int]:
    """``count`` request sizes of the named mix (see :data:`REQUEST_MIXES`), seeded."""
    lo, hi = REQUEST_MIXES[mix]
    rng = random.Random(f"concurrency:{mix}:{seed}")
    return [rng.randint(lo, hi) for _ in range(count)]


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of the mixed trace."""

    index: int
    kind: str
    """``text``, ``image``, ``multi_image`` or ``video``."""
    tokens: int
    """Multimodal tokens to transfer (0 for text-only requests)."""
    items: int
    """Images or videos in the request (0 for text)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def generate_trace(num_requests: int, seed: int = 0) -> list[TraceRequest]:
    """A reproducible mixed multimodal trace of ``num_requests`` requests (see the module doc)."""
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests} must be >= 0")
    rng = random.Random(seed)
    kinds = [k for k, _ in TRACE_KINDS]
    weights = [w for _, w in TRACE_KINDS]
    out: list[TraceRequest] = []
    for i in range(num_requests):
        kind = rng.choices(kinds, weights)[0]
        if kind == "text":
            tokens, items = 0, 0
        elif kind == "image":
            tokens, items = rng.randint(*IMAGE_TOKENS), 1
        elif kind == "multi_image":
            items = rng.randint(*MULTI_IMAGE_COUNT)
            tokens = sum(rng.randint(*IMAGE_TOKENS) for _ in range(items))
        else:
            tokens, items = rng.randint(*VIDEO_TOKENS), 1
        out.append(TraceRequest(index=i, kind=kind, tokens=tokens, items=items))
    return out


def trace_summary(trace: Sequence[TraceRequest]) -> dict[str, Any]:
    """Counts and token totals per kind, for the report."""
    kinds: dict[str, dict[str, int]] = {}
    for r in trace:
        k = kinds.setdefault(r.kind, {"requests": 0, "tokens": 0, "max_tokens": 0})
        k["requests"] += 1
        k["tokens"] += r.tokens
        k["max_tokens"] = max(k["max_tokens"], r.tokens)
    return {
        "requests": len(trace),
        "transferred_requests": sum(1 for r in trace if r.tokens > 0),
        "tokens": sum(r.tokens for r in trace),
        "kinds": kinds,
    }
