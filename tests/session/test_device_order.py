"""Ordering with device streams, as far as a CPU host can test it: the session logic that gives a
lease's blocks back only once its consumer's work is done (with a fence the test completes by hand),
and the ``out=`` device checks. The CUDA paths themselves run in the GPU suite
(:mod:`aioembed.testing.gpu`, marked ``cuda``), on hosts with a GPU."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, InvalidRequest, TransferConfig
from aioembed.memory.device_order import fence_after, wait_fence
from aioembed.session.lease import LeaseReturns

from .conftest import LAYOUT

pytestmark = pytest.mark.anyio


class HandFence:
    """A fence the test completes (a consumer's kernels finishing)."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def complete(self) -> None:
        self._done.set()


async def test_blocks_go_back_only_once_the_consumers_work_is_done() -> None:
    returned: list[list[int]] = []
    async with anyio.create_task_group() as tg:
        returns = LeaseReturns(returned.append, tg.start_soon)
        fence = HandFence()
        returns.release([1, 2], fence)  # the consumer's kernels still read these blocks
        returns.release([3], None)  # a lease with nothing queued on it goes back at once
        await anyio.sleep(0.05)
        assert returned == [[3]] and returns.fenced == 1
        fence.complete()
        with anyio.fail_after(5):
            while returns.fenced:
                await anyio.sleep(0.005)
        assert returned == [[3], [1, 2]]


async def test_a_release_from_another_thread_waits_for_its_fence_too() -> None:
    returned: list[list[int]] = []
    async with anyio.create_task_group() as tg:
        returns = LeaseReturns(returned.append, tg.start_soon)
        fence = HandFence()
        await anyio.to_thread.run_sync(returns.release, [7], fence)  # e.g. a worker thread's finalizer
        returns.drain()  # the loop's next heartbeat
        await anyio.sleep(0.05)
        assert returned == [] and returns.fenced == 1
        fence.complete()
        with anyio.fail_after(5):
            while not returned:
                await anyio.sleep(0.005)
        assert returned == [[7]]


async def test_a_release_from_another_thread_wakes_the_loop_and_still_waits_for_its_fence() -> None:
    returned: list[list[int]] = []
    async with anyio.create_task_group() as tg:
        returns = LeaseReturns(returned.append, tg.start_soon)
        fence = HandFence()
        await anyio.to_thread.run_sync(returns.release, [7], fence)  # no heartbeat drains the queue here
        with anyio.fail_after(5):
            while returns.pending:  # the woken loop takes it up ...
                await anyio.sleep(0.005)
        await anyio.sleep(0.05)
        assert returned == [] and returns.fenced == 1  # ... but the consumer's work is not done
        fence.complete()
        with anyio.fail_after(5):
            while not returned:
                await anyio.sleep(0.005)
        assert returned == [[7]]


async def test_cpu_tensors_need_no_fence() -> None:
    assert fence_after([torch.zeros(4)]) is None
    await wait_fence(None)  # nothing to wait for


async def test_out_on_another_device_is_refused_naming_both() -> None:
    async with EmbeddingReceiver(LAYOUT, TransferConfig()) as receiver:
        out = {name: torch.empty((8, *f.shape), dtype=f.dtype, device="meta") for name, f in LAYOUT.items()}
        with pytest.raises(InvalidRequest, match=r"is on meta.*CPU pool|is on meta; the pool is on cpu"):
            receiver.start("r", out=out, sender="tcp://127.0.0.1:1")
