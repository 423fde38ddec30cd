"""A room assembled from parts that several encoders send: ``receive(room, parts=[...])``.

A multimodal request whose images went to different encoders arrives in parts: each encoder sends
its part (a token range of the room, known to the language side from the request) with
``send(room, rows, part=i)``. Each part is received by its own room driver, from its own sender,
under the wire id ``(room, i)``: reserved, resumed and fenced like any room, so one sender's
failure touches only its part. The room completes when every part has: rows in token order (each
part copies into its slice of one output), metadata merged in part order. A part that fails fails
the room, naming the part and its sender; the other parts end too, their blocks following the
ownership rules (fenced where a write may still land).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import anyio
import torch

from aioembed.errors import InvalidRequest, TransferAborted, TransferError, TransferTimeout
from aioembed.protocol.messages import MAX_PARTS, RoomId, TransferStatus
from aioembed.session.handle import Received, ReceiveHandle, TransferStats
from aioembed.session.lease import Lease

__all__ = ["Part", "RoomAssembly", "check_parts", "part_output"]

log = logging.getLogger("aioembed.session.receiver")


@dataclass(frozen=True, slots=True)
class Part:
    """One encoder's share of a room: tokens ``[start, end)``, sent by the sender at ``sender`` with
    ``send(room, rows, part=i)``, ``i`` being this part's index in the list given to ``receive``."""

    sender: str
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


def check_parts(room: RoomId, parts: Iterable[Part], max_tokens: int) -> list[Part]:
    """Validate that ``parts`` tile ``[0, total)`` in order; returns them with plain ``int`` bounds (bounds
    from a prefix sum are often numpy integers), the last one ending at ``total``. Any iterable of parts is taken
    (a generator is read once, here); anything else is an ``InvalidRequest``, not ``len()``'s ``TypeError``."""
    if not isinstance(parts, Iterable):
        raise InvalidRequest(f"room {room!r}: parts must be a list of aioembed.Part, got {type(parts).__name__}")
    parts = list(parts)
    if not parts or len(parts) > MAX_PARTS:
        raise InvalidRequest(f"room {room!r}: parts must list 1..{MAX_PARTS} parts, got {len(parts)}")
    expect = 0
    checked = []
    for i, p in enumerate(parts):
        if not isinstance(p, Part):
            raise InvalidRequest(f"room {room!r}: parts[{i}] must be an aioembed.Part, got {type(p).__name__}")
        if not isinstance(p.sender, str) or not p.sender:
            raise InvalidRequest(f"room {room!r}: parts[{i}].sender must be a sender address, got {p.sender!r}")
        try:
            if isinstance(p.start, bool) or isinstance(p.end, bool):
                raise TypeError
            start, end = operator.index(p.start), operator.index(p.end)
        except TypeError:
            raise InvalidRequest(f"room {room!r}: parts[{i}] bounds must be integers, got start={p.start!r}, "
                                 f"end={p.end!r}") from None
        if start != expect or end <= start:
            raise InvalidRequest(f"room {room!r}: parts must cover tokens 0..total in order without gaps or "
                                 f"overlaps; parts[{i}] is [{start}, {end}), expected it to start at {expect}")
        checked.append(Part(p.sender, start, end))
        expect = end
    if expect > max_tokens:
        raise InvalidRequest(f"room {room!r}: {expect} tokens in its parts; max_request_tokens={max_tokens}")
    return checked


def part_output(output: Mapping[str, torch.Tensor] | None, part: Part) -> dict[str, torch.Tensor] | None:
    """The slice of the room's output that ``part`` copies into (``None``: zero-copy, no output)."""
    return None if output is None else {n: t[part.start:part.end] for n, t in output.items()}


class RoomAssembly:
    """Waits for the parts of one room and resolves its handle (see the module docstring). Every part's
    driver is set up and started before the assembly exists (``handles``, in part order), so a part that
    cannot start fails the ``receive()`` call itself."""

    def __init__(self, room: RoomId, handle: ReceiveHandle, parts: Sequence[Part], handles: Sequence[ReceiveHandle],
                 *, zero_copy: bool, output: dict[str, torch.Tensor] | None) -> None:
        self.room = room
        self.handle = handle
        self.parts = list(parts)
        self.zero_copy = zero_copy
        self.output = output
        self._handles = list(handles)
        handle._parts = self._handles
        self._failed: list[int] = []  # parts in the order they failed (the first failed on its own)

    async def run(self) -> None:
        """The room's task: waits for every part, resolves the room's handle, whatever ends it (the receiver
        closing cancels this task from outside: a ``receive(parts=...)`` caller must not wait for ever)."""
        try:
            await self._run()
        except BaseException:
            if not self.handle.done:
                reason = "the receiver closed while its parts were in flight"
                for h in self._handles:
                    # Not waited for (this task is being cancelled): a part still going gives back the lease
                    # it may yet end with (its last frame in hand) when it ends; one that ended gives it back now.
                    h._orphan(reason)
                self.handle._finish(error=TransferAborted(f"room {self.room!r}: {reason}", room=self.room),
                                    status=TransferStatus.ABORTED)
            raise

    async def _run(self) -> None:
        t0 = time.perf_counter()
        assert self.handle._scope is not None
        with self.handle._scope:
            async with anyio.create_task_group() as tg:
                for i, h in enumerate(self._handles):
                    tg.start_soon(self._watch, i, h)
        results = [h._result for h in self._handles]
        if all(r is not None for r in results) and self.handle._cancel_reason is None:
            self.handle._finish(result=self._combine(results, time.perf_counter() - t0),
                                status=TransferStatus.SUCCESS)
            return
        for h in self._handles:  # the room is over: any part still going ends too
            h.cancel(self.handle._cancel_reason or f"room {self.room!r} failed in another part")
        with anyio.CancelScope(shield=True):
            for h in self._handles:
                await h.wait()
        error = self._first_error()
        # What the parts ended with, not what they had when the group ended: a part whose last frame was
        # handed to it before its cancel completes anyway, with a lease.
        self._release([h._result for h in self._handles])
        status = TransferStatus.ABORTED if isinstance(error, TransferAborted) else TransferStatus.FAILED
        self.handle._finish(error=error, status=status)

    async def _watch(self, index: int, h: ReceiveHandle) -> None:
        await h.wait()
        if h._error is not None:
            self._failed.append(index)
            if len(self._failed) == 1:  # the first failure ends the other parts
                for other in self._handles:
                    other.cancel(f"part {index} of room {self.room!r} (sender {self.parts[index].sender}) failed")

    def _first_error(self) -> TransferError:
        if self.handle._cancel_reason is not None:
            return TransferAborted(f"room {self.room!r}: {self.handle._cancel_reason}", room=self.room)
        i = self._failed[0]
        cause = self._handles[i]._error
        assert cause is not None
        part = self.parts[i]
        what = (f"room {self.room!r}: part {i} (tokens {part.start}..{part.end}) from sender {part.sender} "
                f"failed: {cause}")
        if isinstance(cause, TransferTimeout):
            return TransferTimeout(what, room=self.room, phase=cause.phase)
        try:
            return type(cause)(what, room=self.room)  # the part's error class: PeerDead, TransferAborted, ...
        except TypeError:  # an error class with other arguments: keep the message
            return TransferError(what, room=self.room)

    @staticmethod
    def _release(results: Sequence[Received | Lease | None]) -> None:
        for r in results:
            if isinstance(r, Lease):
                r.release()  # a part that arrived, of a room that did not

    def _combine(self, results: Sequence[Received | Lease | None], seconds: float) -> Received | Lease:
        metas = [dict(r.metadata) for r in results if r is not None]
        merged: dict[str, Any] = {}
        for m in metas:
            merged.update(m)
        total = self.parts[-1].end
        stats = TransferStats(bytes=sum(r.stats.bytes for r in results if r is not None),
                              rounds=max(r.rounds for r in results if r is not None), seconds=seconds)
        if self.zero_copy:
            leases = [r for r in results if isinstance(r, Lease)]
            combined = Lease.combine(self.room, leases, metadata=merged, stats=stats)
            combined.part_metadata = tuple(metas)
            return combined
        assert self.output is not None
        return replace(Received(room=self.room, tensors=self.output, metadata=merged, num_tokens=total,
                                rounds=stats.rounds, stats=stats), part_metadata=tuple(metas))
