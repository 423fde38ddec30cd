"""``EmbeddingSender.register_sources()``: buffers registered once; a ``send()`` from inside them is written
from them directly (no staging copy, no registration per send), and ``aclose()`` unregisters them only
once no write reads them."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, InvalidRequest, RegisteredSources, TransferConfig
from aioembed.errors import TransportError
from aioembed.testing import MockTransport, WriteCall, WriteFault
from aioembed.transports.base import MemoryRegion

from .conftest import LAYOUT, assert_same, make_request

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=8192, staging_tokens=512, staging_max_tokens=256,
                     handshake_timeout=2.0, input_timeout=5.0, room_timeout=10.0)


class CountingTransport(MockTransport):
    """Counts the sender's register() and unregister() calls."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.registered: list[list[MemoryRegion]] = []
        self.unregistered: list[list[MemoryRegion]] = []

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.registered.append(list(regions))
        await super().register(regions)

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self.unregistered.append(list(regions))
        await super().unregister(regions)


def _buffers(tokens: int) -> dict[str, torch.Tensor]:
    return LAYOUT.empty(tokens)


def _fill(buffers: dict[str, torch.Tensor], at: int, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``rows`` written into ``buffers`` from row ``at``; the slices a send() passes."""
    n = next(iter(rows.values())).shape[0]
    out = {}
    for name, t in rows.items():
        buffers[name][at:at + n].copy_(t)
        out[name] = buffers[name][at:at + n]
    return out


async def _pair(writer: MockTransport) -> tuple[EmbeddingSender, EmbeddingReceiver]:
    sender = EmbeddingSender(LAYOUT, CFG, transport=writer)
    await sender.__aenter__()
    receiver = EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport())
    await receiver.__aenter__()
    await receiver.wait_connected()
    return sender, receiver


async def _close(sender: EmbeddingSender, receiver: EmbeddingReceiver) -> None:
    await receiver.aclose()
    await sender.aclose()


async def test_sends_from_registered_buffers_neither_stage_nor_register() -> None:
    writer = CountingTransport()
    sender, receiver = await _pair(writer)
    try:
        buffers = _buffers(4096)
        kept = await sender.register_sources(*buffers.values())
        assert isinstance(kept, RegisteredSources) and sender.source_buffers == 1
        registers = len(writer.registered)
        assert sender._staging is not None
        staged = 0
        stage = sender._staging.stage

        def counting_stage(tensors: object, num_tokens: int) -> object:
            nonlocal staged
            staged += 1
            return stage(tensors, num_tokens)  # type: ignore[arg-type]

        sender._staging.stage = counting_stage  # type: ignore[method-assign]
        # Small (would be staged) and large (would be registered) requests, at the start and inside.
        for i, (at, n) in enumerate([(0, 64), (100, 64), (0, 2000), (1500, 2500)]):
            want = make_request(n, seed=i)
            rows = _fill(buffers, at, want)
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, f"r{i}", rows)
                got = await receiver.receive(f"r{i}")
            assert_same(got.tensors, want)
        assert staged == 0 and len(writer.registered) == registers and writer.unregistered == []
        assert kept.in_use == 0 and sender.sources_held == 0
        # A request from other memory goes the usual way (staged).
        want = make_request(64, seed=9)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "other", want)
            got = await receiver.receive("other")
        assert_same(got.tensors, want)
        assert staged == 1

        await kept.aclose()
        assert kept.closed and sender.source_buffers == 0
        assert writer.unregistered == [list(kept.regions)]
        assert all(not any(r.address <= x.address < r.end for x in writer.regions) for r in kept.regions)
        # The same buffers once closed: an ordinary send() again (a large one registers its own tensors).
        want = make_request(2000, seed=10)
        rows = _fill(buffers, 0, want)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "after", rows)
            got = await receiver.receive("after")
        assert_same(got.tensors, want)
        assert len(writer.registered) == registers + 1
    finally:
        await _close(sender, receiver)


async def test_a_request_partly_outside_the_buffers_is_sent_the_usual_way() -> None:
    writer = CountingTransport()
    sender, receiver = await _pair(writer)
    try:
        buffers = _buffers(1024)
        async with await sender.register_sources(*buffers.values()):
            registers = len(writer.registered)
            want = make_request(1000, seed=3)
            rows = _fill(buffers, 0, want)
            rows["token_ids"] = rows["token_ids"].clone()  # one field elsewhere
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "r", rows)
                got = await receiver.receive("r")
            assert_same(got.tensors, want)
            assert len(writer.registered) == registers + 1  # this send() registered its own tensors
    finally:
        await _close(sender, receiver)


async def test_aclose_waits_until_no_write_reads_the_buffers() -> None:
    slow = anyio.Event()

    def faults(call: WriteCall) -> WriteFault | None:
        return WriteFault(delay=0.5) if slow.is_set() else None

    writer = CountingTransport(faults=faults)
    sender, receiver = await _pair(writer)
    try:
        buffers = _buffers(1024)
        kept = await sender.register_sources(*buffers.values())
        want = make_request(300, seed=4)
        rows = _fill(buffers, 0, want)
        slow.set()
        sent_at: list[float] = []

        async def send() -> None:
            await sender.send("r", rows)
            sent_at.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            handle = receiver.start("r")
            with anyio.fail_after(5):
                while kept.in_use == 0:
                    await anyio.sleep(0.005)
            await kept.aclose()
            closed_at = time.monotonic()
            assert sent_at and closed_at >= sent_at[0]  # not before the write ended and send() returned
            got = await handle.result()
        assert_same(got.tensors, want)
        assert writer.unregistered == [list(kept.regions)] and sender.sources_held == 0
    finally:
        await _close(sender, receiver)


async def test_a_failed_write_that_may_still_land_holds_the_buffers_for_its_lifetime() -> None:
    lifetime = 0.6
    fail = anyio.Event()

    def faults(call: WriteCall) -> WriteFault | None:
        if fail.is_set():
            return WriteFault(error=TransportError("link dropped", may_land=True), land_after=0.2)
        return None

    writer = CountingTransport(cancel_safe_writes=False, write_lifetime=lifetime, faults=faults)
    sender, receiver = await _pair(writer)
    try:
        buffers = _buffers(1024)
        kept = await sender.register_sources(*buffers.values())
        rows = _fill(buffers, 0, make_request(300, seed=5))
        fail.set()
        async with anyio.create_task_group() as tg:
            handle = receiver.start("r")
            with pytest.raises(Exception):  # noqa: B017 - the room fails: its type is the session's to say
                await sender.send("r", rows)
            failed_at = time.monotonic()
            assert kept.in_use == 1  # the write may still read them
            await kept.aclose()
            assert time.monotonic() - failed_at >= lifetime * 0.9
            assert kept.in_use == 0 and writer.unregistered == [list(kept.regions)]
            await handle.wait()
            tg.cancel_scope.cancel()
    finally:
        await _close(sender, receiver)


async def test_register_sources_refuses_what_cannot_be_one_registration() -> None:
    writer = CountingTransport()
    sender, receiver = await _pair(writer)
    try:
        with pytest.raises(InvalidRequest, match="not contiguous"):
            await sender.register_sources(torch.zeros(8, 8).t())
        with pytest.raises(InvalidRequest, match="at least one"):
            await sender.register_sources()
        with pytest.raises(InvalidRequest, match="empty"):
            await sender.register_sources(torch.zeros(0))
        assert sender.source_buffers == 0
    finally:
        await _close(sender, receiver)


async def test_the_senders_close_ends_registered_buffers() -> None:
    writer = CountingTransport()
    sender, receiver = await _pair(writer)
    kept = await sender.register_sources(*_buffers(256).values())
    await _close(sender, receiver)
    assert kept.closed
    with anyio.fail_after(1):
        await kept.aclose()  # at once: the closed transport dropped the registration
