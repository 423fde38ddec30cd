"""The control floor (``aioembed bench --control-floor``): the raw transfer framed by the two control
messages any receiver-driven transfer needs, timed in a bare peer process.

Checks what the floor measures (the transfer lies inside the span the peer read), never how fast."""

from __future__ import annotations

import subprocess
import sys
import time

import anyio
import pytest

from aioembed.bench.control_floor import ControlFloor
from aioembed.bench.measure import BenchOptions, Measurer
from aioembed.config import TransferConfig
from aioembed.errors import ConfigError, TransportError

pytestmark = pytest.mark.anyio


async def test_the_span_holds_the_transfer_between_the_peers_request_and_its_done() -> None:
    floor = ControlFloor(timeout=30)
    try:
        await floor.start()
        ran: list[tuple[float, float]] = []

        async def transfer() -> None:
            start = time.monotonic()
            await anyio.sleep(0.02)
            ran.append((start, time.monotonic()))

        for _ in range(3):
            t0, t1 = await floor.span(transfer)
            start, end = ran[-1]
            assert t0 <= start and end <= t1  # one clock (CLOCK_MONOTONIC) in both processes
        seconds = await floor.time(transfer)
        assert seconds >= ran[-1][1] - ran[-1][0] and len(ran) == 4
    finally:
        await floor.aclose()
    assert floor._peer._proc is None  # the peer was asked to exit and waited for


@pytest.mark.parametrize("error", [RuntimeError("the raw transfer failed"),
                                   TimeoutError("raw baseline: no ack within write_timeout")])
async def test_a_failed_transfer_raises_its_own_error_and_leaves_the_floor_usable(error: Exception) -> None:
    """Its own error, a TimeoutError too (UCX's raw baseline waits for its ack with a deadline): not one saying
    that the floor peer was silent."""
    floor = ControlFloor(timeout=30)
    try:
        await floor.start()

        async def failing() -> None:
            raise error

        with pytest.raises(type(error), match=str(error)):
            await floor.time(failing)
        assert await floor.time(anyio.lowlevel.checkpoint) > 0
    finally:
        await floor.aclose()


async def test_a_peer_that_died_is_an_error_naming_the_floor_within_its_timeout() -> None:
    floor = ControlFloor(timeout=1.0)
    try:
        await floor.start()
        proc = floor._peer._proc
        assert proc is not None
        proc.kill()
        await proc.wait()
        said = r"the floor peer did not (take b'prime'|answer) within 1\.0 s"  # gone: its socket with it
        with anyio.fail_after(10), pytest.raises(TransportError, match=said):
            await floor.time(anyio.lowlevel.checkpoint)
    finally:
        await floor.aclose()


async def test_a_floor_needs_a_raw_baseline_in_another_process() -> None:
    """Loopback's raw baseline copies inside this process: framing it in two process hops would compare
    nothing real, so the sizes workload refuses the option, naming it."""
    from aioembed.bench.baselines import LoopbackBaseline

    base = TransferConfig(transport="loopback")
    m = Measurer(BenchOptions(base_config=base, control_floor=True, sizes=(16,), repeat=1), LoopbackBaseline,
                 lambda s: None)
    with pytest.raises(ConfigError, match="--control-floor needs a raw baseline that crosses processes"):
        await m.run_sizes()


@pytest.mark.parametrize("args, said", [
    (["--workloads", "resume", "--control-floor"], "add sizes to --workloads"),
    (["--workloads", "sizes", "--sizes", "16", "--control-floor"],
     "needs a raw baseline that crosses processes; transport 'loopback' has one in this process"),
])
def test_the_command_refuses_a_floor_it_cannot_measure_before_it_runs_anything(args: list[str], said: str) -> None:
    proc = subprocess.run([sys.executable, "-c", "from aioembed.cli import main; main()", "bench", *args],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-2000:]
    assert "sizes:" not in proc.stdout  # refused up front: no workload ran
