"""A transport that reads unregistered CPU sources (``Transport.reads_unregistered``: Mooncake and UCX over TCP):
the sender writes straight from the caller's tensors, with no staging area, no staging copy and no registration
per ``send()``; the tensors are still held until no write reads them, a write that may still land included."""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig, TransferFailed, TransportError
from aioembed.testing import MockTransport, WriteCall, WriteFault
from aioembed.testing.source_buffers import send_and_check
from aioembed.transports.base import MemoryRegion

from .conftest import LAYOUT, make_request, wait_pools_free

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=8192, staging_tokens=512, staging_max_tokens=256,
                     handshake_timeout=2.0, input_timeout=5.0, round_timeout=2.0, room_timeout=10.0)


class CountingTransport(MockTransport):
    """Counts register() and unregister() calls; reads unregistered CPU sources unless told otherwise."""

    def __init__(self, **kwargs: object) -> None:
        kwargs.setdefault("unregistered_sources", True)
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.registered: list[list[MemoryRegion]] = []
        self.unregistered: list[list[MemoryRegion]] = []
        self.sources: list[int] = []

    async def register(self, regions: Sequence[MemoryRegion]) -> None:
        self.registered.append(list(regions))
        await super().register(regions)

    async def unregister(self, regions: Sequence[MemoryRegion]) -> None:
        self.unregistered.append(list(regions))
        await super().unregister(regions)


def _pointers(tensors: dict[str, torch.Tensor]) -> set[int]:
    return {t.data_ptr() for t in tensors.values()}


def _inside(address: int, length: int, tensors: dict[str, torch.Tensor]) -> bool:
    """``[address, +length)`` lies inside one of ``tensors``."""
    return any(t.data_ptr() <= address and address + length <= t.data_ptr() + t.numel() * t.element_size()
               for t in tensors.values())


async def test_sends_read_the_callers_tensors_unregistered() -> None:
    calls: list[WriteCall] = []
    writer = CountingTransport(faults=lambda call: calls.append(call) or None)  # type: ignore[func-returns-value]
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        assert sender._staging is None and writer.registered == []  # no staging area: nothing to copy into
        # A small request (else staged), a large one (else registered) and one in three rounds.
        for i, n in enumerate([64, 256, 1000, 3000]):
            want = make_request(n, seed=i)
            calls.clear()
            await send_and_check(sender, receiver, f"r{i}", want, want)
            ops = [op for call in calls for op in call.ops]
            assert ops and all(_inside(op.src, op.length, want) for op in ops), "a write did not read the caller's rows"
            assert sum(op.length for op in ops) == n * LAYOUT.bytes_per_token
        assert len(calls) >= 2  # the last request took rounds (a 1024-token default reservation)
        assert writer.registered == [] and writer.unregistered == []
        assert sender.sources_held == 0 and len(writer.regions) == 0


async def test_a_registering_transport_still_stages_and_registers() -> None:
    writer = CountingTransport(unregistered_sources=False)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        assert sender._staging is not None and len(writer.registered) == 1  # the staging area
        for i, n in enumerate([64, 3000]):
            want = make_request(n, seed=i)
            await send_and_check(sender, receiver, f"r{i}", want, want)
        assert len(writer.registered) == 2 and len(writer.unregistered) == 1  # the large send()'s own tensors
        assert sender.sources_held == 0


async def test_a_write_that_may_still_land_holds_the_unregistered_source() -> None:
    """The tensors of a failed write that may still read them stay referenced (``sources_held``) until the
    transport's write lifetime passed, as registered ones stay registered: the allocator does not hand their
    memory to anyone while the engine may read it."""
    late = WriteFault(error=TransportError("write timed out; the destination may still be written"),
                      fail_after=0.05, land_after=0.4)
    lifetime = 1.0
    writer = CountingTransport(cancel_safe_writes=False, write_lifetime=lifetime,
                               faults=lambda call: late if call.index == 0 else None)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        src = make_request(64, seed=5)
        failures: list[TransferFailed] = []

        async def send() -> None:
            try:
                await sender.send("r", src)
            except TransferFailed as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferFailed, match="may still be written"):
                await receiver.receive("r")
        assert failures
        t_failed = time.monotonic()
        held = sender.sources_held
        kept = [t for s in sender._sources.values() for t in s.tensors]
        assert held == 1 and _pointers(src) <= {t.data_ptr() for t in kept}
        assert writer.registered == []
        # Another room goes on meanwhile, from its own unregistered tensors.
        want = make_request(300, seed=6)
        await send_and_check(sender, receiver, "next", want, want)
        await wait_pools_free(sender, receiver, timeout=lifetime + 3.0)
        assert sender.sources_held == 0 and time.monotonic() - t_failed >= lifetime * 0.9
        assert writer.registered == [] and writer.unregistered == []
