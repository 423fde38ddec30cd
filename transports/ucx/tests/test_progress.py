"""The worker's progress in ``blocking`` mode: event-driven, re-armed after every event, and waits on
requests that never poll, so an idle endpoint (a listener waiting for the next write included) costs
almost no CPU. With ucxx 0.52's own ``BlockingMode`` and ``wait_yield``, each of these processes spun
at about 1 CPU-s/s."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from aioembed.testing import region_of
from aioembed.transports.base import WriteOp
from aioembed.transports.registry import open_transport

from aioembed_ucx._progress import ArmedProgress

from .conftest import UCX_OPTIONS

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(UCX_OPTIONS["progress_mode"] != "blocking",
                       reason="the event-driven progress replaces ucxx's in blocking mode only"),
]

OWNER = Path(__file__).with_name("_owner.py")
SIZE = 1 << 20
BUDGET = 0.01  # CPU-s/s


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _driver() -> ArmedProgress:
    app = importlib.import_module("ucxx._lib_async.application_context")
    driver = app.ProgressTasks[asyncio.get_running_loop()]
    assert isinstance(driver, ArmedProgress), driver
    return driver


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_owner() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(OWNER), json.dumps(UCX_OPTIONS), str(SIZE)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)


async def test_an_idle_pair_in_one_process_costs_almost_no_cpu() -> None:
    """Both ends in this process: after a write, the owning side's connection waits for the next header
    (a posted receive), and the writing side has nothing in flight."""
    async with await open_transport("ucx", UCX_OPTIONS) as a, await open_transport("ucx", UCX_OPTIONS) as b:
        src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        await a.register([region_of(src)])
        await b.register([region_of(dst)])
        link = await a.connect(b.descriptor())
        for _ in range(3):
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), SIZE)])
        assert torch.equal(src, dst)
        driver = _driver()
        arms = driver.arms
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(2.0)
        used = (time.process_time() - cpu) / (time.monotonic() - wall)
        print(f"idle: {used:.4f} CPU-s/s for two endpoints, a link and a waiting connection")
        assert used < BUDGET
        # Asleep on the worker's descriptor: re-armed at most once a second by the safety timer.
        assert driver.arms - arms <= 3
        # And still awake to the next write.
        src.fill_(7)
        await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), SIZE)])
        assert torch.equal(src, dst)
        await link.aclose()


async def test_an_idle_owner_process_costs_almost_no_cpu() -> None:
    """The owning side in its own process, after serving writes: its connection waits for the next one."""
    proc = _start_owner()
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())  # once it listens (after its start-up), never raced
        async with await open_transport("ucx", UCX_OPTIONS) as t:
            src = torch.randint(0, 256, (SIZE,), dtype=torch.uint8)
            await t.register([region_of(src)])
            link = await t.connect(bytes.fromhex(info["descriptor"]))
            for _ in range(3):
                await link.write([WriteOp(src.data_ptr(), info["address"], SIZE)])
            cpu, mine, wall = _cpu_seconds(proc.pid), time.process_time(), time.monotonic()
            await asyncio.sleep(3.0)
            elapsed = time.monotonic() - wall
            owner = (_cpu_seconds(proc.pid) - cpu) / elapsed
            writer = (time.process_time() - mine) / elapsed
            print(f"idle: owner process {owner:.4f} CPU-s/s, writing process {writer:.4f} CPU-s/s")
            assert owner < BUDGET and writer < BUDGET
            await link.write([WriteOp(src.data_ptr(), info["address"], SIZE)])  # still served
            await link.aclose()
    finally:
        proc.kill()
        proc.wait()
