"""A failed write on a transport that cannot cancel writes may land later: its blocks are fenced at
once, stay fenced while the write may land, and come back (FENCE_RELEASE) once the transport's
write lifetime has passed, with the sender alive and serving throughout."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig, TransferFailed, TransportError
from aioembed.session.send_room import _one_failure
from aioembed.testing import MockTransport, WriteCall, WriteFault

from ..session.conftest import LAYOUT, assert_same, make_request, wait_pools_free

pytestmark = pytest.mark.anyio

LIFETIME = 1.0
CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, round_timeout=2.0, input_timeout=5.0,
                     resume_reserve_tokens=0)


async def test_failed_uncancellable_write_is_fenced_then_released_by_fence_release() -> None:
    late = WriteFault(error=TransportError("write timed out after 5 s; the destination may still be written"),
                      fail_after=0.05, land_after=0.6)

    def faults(call: WriteCall) -> WriteFault | None:
        return late if call.index == 1 else None  # the second round of the first room

    writer = MockTransport(cancel_safe_writes=False, write_lifetime=LIFETIME, faults=faults)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        failures: list[BaseException] = []

        async def send() -> None:
            try:
                await sender.send("r", make_request(3000, 1))
            except TransferFailed as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferFailed, match="may still be written"):
                await receiver.receive("r")
        t_failed = time.monotonic()
        assert failures and "failed" in str(failures[0])
        st = receiver.allocator.stats
        assert st.fenced > 0 and st.free < st.total  # at once: a late write may land in them
        assert receiver.fenced_blocks == {"write_failed": st.fenced}
        assert len(writer.regions) > 0  # the source stays registered while the write may read it

        # Another room is served meanwhile, and the late write (landing now) does not touch it.
        src = make_request(500, 2)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "next", src)
            lease = await receiver.receive_leased("next")
        async with lease:
            assert await anyio.to_thread.run_sync(late.landed.wait, 5.0), "the late write never landed"
            assert_same(lease.to_tensors(), src)

        # FENCE_RELEASE once the write lifetime passed: back to an empty pool, sender still serving.
        await wait_pools_free(sender, receiver, timeout=LIFETIME + 3.0)
        assert time.monotonic() - t_failed < CFG.round_timeout + 3.0
        assert sender.sources_held == 0 and len(writer.regions) == len(LAYOUT)  # the staging area only
        src3 = make_request(2500, 3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "after", src3)
            got = await receiver.receive("after")
        assert_same(got.tensors, src3)


async def test_a_failed_write_that_settles_later_stays_fenced_past_its_lifetime_until_it_did() -> None:
    """A transport that cannot bound a failed write by time (an engine transfer that gave up at its timeout
    but keeps making progress) but sees it end says so with ``settled``: the blocks stay fenced until then
    (plus ``orphan_lifetime``), even past ``write_lifetime``, while the late bytes land."""
    lifetime, orphan = 0.3, 0.2
    late = WriteFault(fail_after=0.05, land_after=1.5)

    async def settled() -> None:  # the engine saw its last transfer end: the late landing
        assert await anyio.to_thread.run_sync(late.landed.wait, 10.0)

    late.error = TransportError("write did not complete within transfer_timeout; it may still land",
                                may_land=True, settled=settled)

    def faults(call: WriteCall) -> WriteFault | None:
        return late if call.index == 0 else None

    writer = MockTransport(cancel_safe_writes=False, write_lifetime=lifetime, orphan_lifetime=orphan, faults=faults)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_expecting_failure, sender, "slow", make_request(700, 4))
            with pytest.raises(TransferFailed, match="may still land"):
                await receiver.receive("slow")
        fenced = receiver.allocator.stats.fenced
        assert fenced > 0
        await anyio.sleep(lifetime + 0.5)  # the lifetime is over, the write is not
        assert not late.landed.is_set()
        assert receiver.allocator.stats.fenced == fenced, "released before the write settled"
        await wait_pools_free(sender, receiver, timeout=5.0)
        assert late.landed.is_set()  # released only after the late bytes landed
        src = make_request(900, 5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "next", src)
            got = await receiver.receive("next")
        assert_same(got.tensors, src)


async def _send_expecting_failure(sender: EmbeddingSender, room: str, src: dict[str, torch.Tensor]) -> None:
    with pytest.raises(TransferFailed):
        await sender.send(room, src)


def test_a_round_whose_chunks_failed_may_land_if_any_chunk_may() -> None:
    """The first chunk refused cleanly, a later one may still land: the round's failure must say it may land
    (it said what the first said, and the blocks were freed under the later chunk)."""
    clean = TransportError("refused", may_land=False)
    landing = TransportError("timed out", may_land=True)
    combined = _one_failure([clean, landing])
    assert isinstance(combined, TransportError) and combined.may_land is True and combined.settled is None
    assert _one_failure([clean, TransportError("again", may_land=False)]).may_land is False  # type: ignore[union-attr]
    assert _one_failure([clean, TransportError("unknown")]).may_land is None  # type: ignore[union-attr]
    bug = RuntimeError("a bug of ours")
    assert _one_failure([clean, bug]) is bug


async def test_a_round_settles_once_every_chunk_that_may_land_settled() -> None:
    order: list[str] = []

    def settle(name: str) -> Callable[[], Awaitable[None]]:
        async def wait() -> None:
            await anyio.lowlevel.checkpoint()
            order.append(name)
        return wait

    combined = _one_failure([TransportError("a", may_land=True, settled=settle("a")),
                             TransportError("b", may_land=False),
                             TransportError("c", may_land=True, settled=settle("c"))])
    assert isinstance(combined, TransportError) and combined.settled is not None
    await combined.settled()
    assert order == ["a", "c"]
    # "d" cannot say when it ended: the write lifetime bounds it (the ledger's floor); "a" is still waited for
    mixed = _one_failure([TransportError("a", may_land=True, settled=settle("a")), TransportError("d")])
    assert isinstance(mixed, TransportError) and mixed.settled is not None
    order.clear()
    await mixed.settled()
    assert order == ["a"]
    bare = _one_failure([TransportError("e", may_land=True), TransportError("d")])
    assert isinstance(bare, TransportError) and bare.settled is None


_STALL_CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, round_timeout=2.0, input_timeout=5.0,
                            resume_reserve_tokens=0, heartbeat_interval=0.2)
"""For the stall tests: heartbeats every 0.2 s, so a 1.4 s freeze is one the loop watches see."""


def _first_write_fails_and_may_land(*, write_lifetime: float) -> MockTransport:
    """A writer whose first write fails as one that may still land (it never does: the tests watch the fences)."""
    late = WriteFault(error=TransportError("write timed out; the destination may still be written"),
                      fail_after=0.05, land_after=None)
    return MockTransport(cancel_safe_writes=False, write_lifetime=write_lifetime,
                         faults=lambda call: late if call.index == 1 else None)


async def _room_r_fails(sender: EmbeddingSender, receiver: EmbeddingReceiver, address: str | None = None) -> None:
    """Room ``r`` through a writer of :func:`_first_write_fails_and_may_land`: it fails on both sides."""
    async with anyio.create_task_group() as tg:
        async def send() -> None:
            with pytest.raises(TransferFailed):
                await sender.send("r", make_request(3000, 1))

        tg.start_soon(send)
        with pytest.raises(TransferFailed, match="may still be written"):
            await receiver.receive("r", sender=address)


async def test_a_stall_of_the_senders_loop_that_ends_before_a_failed_writes_lifetime_restarts_it() -> None:
    """A failed write's lifetime is of the sender's *running* time: a frozen process's engine resumes the write
    when it thaws. A stall the liveness loop saw, but that ended before the write's expiry (so the expiry timer
    itself woke on time), must restart the lifetime from the thaw, not let FENCE_RELEASE go out an instant after
    it (the receiver then frees blocks the thawed write may still reach)."""
    lifetime, stall = 2.0, 1.4
    cfg = _STALL_CFG
    writer = _first_write_fails_and_may_land(write_lifetime=lifetime)
    async with EmbeddingSender(LAYOUT, cfg, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
        await _room_r_fails(sender, receiver)
        assert sender.writes_in_flight == 1
        time.sleep(stall)  # noqa: ASYNC251  (the point: the process freezes, well within the lifetime)
        thawed = anyio.current_time()
        await anyio.sleep(lifetime / 2)
        assert sender.writes_in_flight == 1, (
            f"the failed write was taken as over {anyio.current_time() - thawed:.2f} s after a {stall} s stall, "
            f"within its {lifetime} s lifetime of running time")
        assert receiver.allocator.stats.fenced > 0
        await wait_pools_free(sender, receiver, timeout=lifetime + 3.0)  # released in the end
        assert anyio.current_time() - thawed >= lifetime


async def test_a_stall_of_the_receivers_loop_restarts_a_gone_senders_orphan_lifetime_with_no_session_live() -> None:
    """A sender known gone (its address refuses connections): its fenced blocks are freed after the transport's
    ``orphan_lifetime`` of the receiver's *running* time (bytes in our socket buffers land at a thaw). Stalls were
    seen only by live sessions' heartbeats, and there is none with a gone sender, or by the release timer when it
    slept across its deadline: a freeze that ended before the deadline left the blocks freed an instant after it."""
    orphan, stall = 2.0, 1.4
    cfg = _STALL_CFG
    writer = _first_write_fails_and_may_land(write_lifetime=60.0)
    async with EmbeddingReceiver(LAYOUT, cfg, transport=MockTransport(orphan_lifetime=orphan)) as receiver:
        async with EmbeddingSender(LAYOUT, cfg, transport=writer) as sender:
            address = sender.address
            await _room_r_fails(sender, receiver, address)
        conn = receiver._conns[address]
        with anyio.fail_after(5):
            while conn._gone_sender is None:  # its address refuses connections: the sender is gone
                await anyio.sleep(0.02)
        assert receiver.allocator.stats.fenced > 0 and not conn.ready
        time.sleep(stall)  # noqa: ASYNC251  (the point: the process freezes, well within the orphan lifetime)
        thawed = anyio.current_time()
        await anyio.sleep(orphan / 2)
        assert receiver.allocator.stats.fenced > 0, (
            f"the gone sender's blocks were freed {anyio.current_time() - thawed:.2f} s after a {stall} s stall, "
            f"within its {orphan} s orphan lifetime of running time")
        with anyio.fail_after(orphan + 3.0):
            while receiver.allocator.stats.fenced:  # freed in the end
                await anyio.sleep(0.05)
        assert anyio.current_time() - thawed >= orphan
