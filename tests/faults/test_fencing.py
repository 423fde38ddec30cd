"""A failed write on a transport that cannot cancel writes may land later: its blocks are fenced at
once, stay fenced while the write may land, and come back (FENCE_RELEASE) once the transport's
write lifetime has passed, with the sender alive and serving throughout."""

from __future__ import annotations

import time

import anyio
import pytest

from aioembed import EmbeddingReceiver, EmbeddingSender, TransferConfig, TransferFailed, TransportError
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
