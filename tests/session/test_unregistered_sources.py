"""A transport that reads unregistered CPU sources (``Transport.reads_unregistered``: Mooncake over TCP, UCX
without RDMA): the sender writes straight from the caller's tensors, with no staging area, no staging copy and no
registration per ``send()``; the tensors are still held until no write reads them, a write that may still land
included."""

from __future__ import annotations

import gc
import math
import random
import time
import weakref

import anyio
import pytest
import torch

from aioembed import (
    EmbeddingReceiver,
    EmbeddingSender,
    Field,
    Layout,
    TransferConfig,
    TransferError,
    TransferFailed,
    TransportError,
)
from aioembed.samples import same_rows
from aioembed.testing import MockTransport, WriteCall, WriteFault
from aioembed.testing.source_buffers import rows_in, send_and_check

from .conftest import LAYOUT, CountingTransport, make_request, wait_pools_free

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=8192, staging_tokens=512, staging_max_tokens=256,
                     handshake_timeout=2.0, input_timeout=5.0, round_timeout=2.0, room_timeout=10.0)


def _counting(**kwargs: object) -> CountingTransport:
    """A counting mock that reads unregistered CPU sources unless told otherwise."""
    kwargs.setdefault("unregistered_sources", True)
    return CountingTransport(**kwargs)


def _inside(address: int, length: int, tensors: dict[str, torch.Tensor]) -> bool:
    """``[address, +length)`` lies inside one of ``tensors``."""
    return any(t.data_ptr() <= address and address + length <= t.data_ptr() + t.numel() * t.element_size()
               for t in tensors.values())


async def test_sends_read_the_callers_tensors_unregistered() -> None:
    calls: list[WriteCall] = []
    writer = _counting(faults=lambda call: calls.append(call) or None)  # type: ignore[func-returns-value]
    # Every row written (none inline: see test_inline_rows.py), so every op's source is checked here.
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG.replace(status_inline_bytes=0), connect=sender.address,
                              transport=MockTransport()) as receiver:
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
    writer = _counting(unregistered_sources=False)
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
    writer = _counting(cancel_safe_writes=False, write_lifetime=lifetime,
                               faults=lambda call: late if call.index == 0 else None)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        src = make_request(64, seed=5)
        failures: list[str] = []  # messages only: an exception's traceback would hold the rows in its frames

        async def send(rows: dict[str, torch.Tensor]) -> None:
            try:
                await sender.send("r", rows)
            except TransferFailed as exc:
                failures.append(str(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send, src)
            with pytest.raises(TransferFailed, match="may still be written"):
                await receiver.receive("r")
        assert failures
        t_failed = time.monotonic()
        refs = [weakref.ref(t) for t in src.values()]
        del src
        gc.collect()  # the caller let go of its rows: only the sender holds them now
        assert sender.sources_held == 1 and all(r() is not None for r in refs)
        assert writer.registered == []
        # Another room goes on meanwhile, from its own unregistered tensors.
        want = make_request(300, seed=6)
        await send_and_check(sender, receiver, "next", want, want)
        await wait_pools_free(sender, receiver, timeout=lifetime + 3.0)
        assert sender.sources_held == 0 and time.monotonic() - t_failed >= lifetime * 0.9
        gc.collect()
        assert all(r() is None for r in refs), "the rows are still referenced after the write lifetime"
        assert writer.registered == [] and writer.unregistered == []


@pytest.mark.parametrize("cancel_safe", [False, True])
async def test_a_send_cancelled_mid_write_holds_its_rows_as_long_as_the_write_may_read_them(cancel_safe: bool) -> None:
    lifetime = 1.0
    writer = _counting(cancel_safe_writes=cancel_safe, write_lifetime=lifetime,
                               faults=lambda call: WriteFault(delay=1.0) if call.index == 0 else None)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        src = make_request(64, seed=2)
        refs = [weakref.ref(t) for t in src.values()]

        async def receive() -> None:
            with pytest.raises(TransferError):
                await receiver.receive("r")

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            with anyio.move_on_after(0.3):
                await sender.send("r", src)  # cancelled while its write is under way
        del src
        gc.collect()
        if cancel_safe:  # a cancelled write never reads on: the rows are let go at once
            assert sender.sources_held == 0 and all(r() is None for r in refs)
        else:  # it may still read them: held until the write lifetime passed
            assert sender.sources_held == 1 and all(r() is not None for r in refs)
        await wait_pools_free(sender, receiver, timeout=lifetime + 3.0)
        gc.collect()
        assert sender.sources_held == 0 and all(r() is None for r in refs)


async def test_non_contiguous_and_aliased_fields_arrive_bit_for_bit() -> None:
    """A non-contiguous field is written from its contiguous copy (held with the source), and fields that share
    memory are read where they lie."""
    layout = Layout(a=Field((16,), torch.float32), b=Field((16,), torch.float32))
    writer = _counting()
    async with EmbeddingSender(layout, CFG, transport=writer) as sender, \
            EmbeddingReceiver(layout, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        for n in (64, 3000):
            t = torch.randn(16, n).t()  # non-contiguous
            want = {"a": t.contiguous(), "b": t.contiguous()}
            await send_and_check(sender, receiver, f"t{n}", {"a": t, "b": t}, want)
            w = torch.randn(n + 1, 16)  # two overlapping views of one storage
            await send_and_check(sender, receiver, f"w{n}", {"a": w[:n], "b": w[1:]},
                                 {"a": w[:n].clone(), "b": w[1:].clone()})
        assert sender.sources_held == 0 and writer.registered == []


async def test_registered_buffers_are_still_used_where_sources_need_no_registration() -> None:
    """``register_sources()`` on such a transport: a send() from inside the buffers is written from them (the
    buffers' own path), one from elsewhere from the caller's tensors; neither registers anything per send()."""
    calls: list[WriteCall] = []
    writer = _counting(faults=lambda call: calls.append(call) or None)  # type: ignore[func-returns-value]
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        buffers = LAYOUT.empty(1024)
        async with await sender.register_sources(*buffers.values()) as kept:
            assert len(writer.registered) == 1
            want = make_request(100, seed=3)
            rows = rows_in(buffers, 10, want)
            await send_and_check(sender, receiver, "kept", rows, want)
            assert all(_inside(op.src, op.length, buffers) for call in calls for op in call.ops)
            other = make_request(100, seed=4)
            await send_and_check(sender, receiver, "other", other, other)
            assert len(writer.registered) == 1 and kept.in_use == 0
        assert len(writer.unregistered) == 1 and sender.sources_held == 0


async def test_a_plan_reading_past_the_callers_rows_fails_the_room_before_any_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transport reading unregistered sources does not check them: the sender refuses a bad plan itself."""
    from aioembed.memory.plan import RowRun
    from aioembed.session import send_room

    plan = send_room.plan_row_runs

    def past_the_end(**kwargs: object) -> list[RowRun]:
        return [RowRun(r.src_row + 1, r.dst_row, r.count) for r in plan(**kwargs)]  # type: ignore[arg-type]

    monkeypatch.setattr(send_room, "plan_row_runs", past_the_end)
    calls: list[WriteCall] = []
    writer = _counting(faults=lambda call: calls.append(call) or None)  # type: ignore[func-returns-value]
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        failures: list[TransferFailed] = []

        async def send() -> None:
            try:
                await sender.send("r", make_request(64, seed=1))
            except TransferFailed as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferFailed):
                await receiver.receive("r")
        assert failures and "outside the request's 64 rows" in str(failures[0])
        assert calls == [] and sender.sources_held == 0
        await wait_pools_free(sender, receiver)


async def test_many_rooms_with_failures_and_cancels_hold_and_release_every_source() -> None:
    """48 rooms, 8 at a time, over a transport whose writes fail (and may still land), stall or are cancelled at
    random: every room that succeeds arrives bit for bit, and once the write lifetime passed every caller's rows
    are let go (weak references dead), nothing is held and both pools are free."""
    rng = random.Random(48)
    lifetime = 1.0

    def faults(call: WriteCall) -> WriteFault | None:
        x = rng.random()
        if x < 0.15:
            return WriteFault(error=TransportError("link dropped; the destination may still be written"),
                              fail_after=0.01, land_after=0.05)
        if x < 0.3:
            return WriteFault(delay=0.03)
        return None

    writer = _counting(cancel_safe_writes=False, write_lifetime=lifetime, faults=faults)
    refs: list[weakref.ref[torch.Tensor]] = []
    outcomes: dict[str, str] = {}
    sent: dict[int, str] = {}
    held: list[int] = []
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()

        async def room(i: int) -> None:
            n = rng.choice([16, 64, 300, 1500])
            want = make_request(n, seed=100 + i)
            rows = {k: v.clone() for k, v in want.items()}  # what send() reads; only the sender keeps it alive
            refs.extend(weakref.ref(t) for t in rows.values())
            cancel_at = rng.choice([None, None, None, 0.005, 0.02])

            async def send(rows: dict[str, torch.Tensor]) -> None:
                sent[i] = "cancelled"
                with anyio.move_on_after(cancel_at if cancel_at is not None else math.inf):
                    try:
                        await sender.send(f"r{i}", rows)
                        sent[i] = "ok"
                    except TransferError as exc:
                        sent[i] = str(exc)  # the message only: its traceback would hold the rows

            mine = refs[-len(want):]
            got = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(send, rows)
                del rows
                try:
                    got = await receiver.receive(f"r{i}")
                except TransferError:
                    outcomes[f"r{i}"] = "failed"
            if "may still be written" in sent[i]:
                # Its write failed and may still read the rows: the sender holds them (its send() has returned).
                assert all(r() is not None for r in mine), f"room r{i}: rows let go while a write may read them"
                held.append(i)
            if got is None:
                return
            assert same_rows(got.tensors, want), f"room r{i}: the rows differ"
            assert sent[i] in ("ok", "cancelled"), f"room r{i} arrived, but its send() raised {sent[i]}"
            outcomes[f"r{i}"] = "ok"

        it = iter(range(48))

        async def worker() -> None:
            for i in it:
                await room(i)

        async with anyio.create_task_group() as tg:
            for _ in range(8):
                tg.start_soon(worker)
        assert len(outcomes) == 48 and "ok" in outcomes.values() and "failed" in outcomes.values()
        assert held, "no write failed in a way that may still land: the holding was not exercised"
        await wait_pools_free(sender, receiver, timeout=lifetime + 5.0)
        assert sender.sources_held == 0 and writer.registered == []
        gc.collect()
        assert all(r() is None for r in refs), "a caller's rows are still referenced once every write ended"
