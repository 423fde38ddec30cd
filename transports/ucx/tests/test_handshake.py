"""A peer stuck in the UCX handshake (ucxx's peer-info exchange) at the owning side's listener.

With ucxx 0.52's own listener (``create_listener``, which the plugin used with ``connect_timeout=1e9``
because ucxx's timeout path frees buffers UCX still writes into), the handshake's ``wait_yield`` polled
on every loop turn: the owner spun at 1 CPU-s/s for as long as such a peer stayed connected, for good.
The plugin's own listener waits without polling, keeps serving other peers, and closes the stuck
connection after ``connect_timeout``."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from aioembed.testing import region_of
from aioembed.transports.base import WriteOp
from aioembed.transports.registry import open_transport

from .conftest import UCX_OPTIONS, ucx_transport
from .test_failures import writer

pytestmark = pytest.mark.anyio

PEER = Path(__file__).with_name("_handshake_peer.py")
SIZE = 1 << 16
DEADLINE = 4.0  # the owner's connect_timeout: how long it gives an incoming connection's handshake
BUDGET = 0.3  # CPU-s/s of the owner's process while the handshake is stuck (ucxx's own: about 1.0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextmanager
def handshake_peer(port: int, mode: str) -> Iterator[subprocess.Popen[bytes]]:
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([sys.executable, str(PEER), "127.0.0.1", str(port), mode],
                                stdout=subprocess.PIPE, stderr=errors)
        try:
            yield proc
        except BaseException:
            errors.seek(0)
            print(f"handshake peer's stderr: {errors.read().decode(errors='replace')[-2000:]}")
            raise
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait()


async def _line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    # Off the loop: the owner must go on serving (the peer's connect needs it) while the test waits.
    return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), timeout)).decode().strip()


@pytest.mark.parametrize("mode", ["silent", "frozen"])
async def test_a_peer_stuck_in_the_handshake_costs_no_cpu_and_is_closed_after_connect_timeout(mode: str) -> None:
    """``silent``: a UCX client that connects and never sends its half of the exchange; ``frozen``: one
    stopped (SIGSTOP) halfway through it, continued after the owner gave up (it then sends its half into
    a closed connection)."""
    options = dict(UCX_OPTIONS, connect_timeout=DEADLINE)
    async with await open_transport("ucx", options) as owner, writer() as (w, src):
        dst = torch.zeros(SIZE, dtype=torch.uint8)
        await owner.register([region_of(dst)])
        descriptor = owner.descriptor()
        local = ucx_transport(owner)
        assert local.port is not None
        with handshake_peer(local.port, mode) as peer:
            assert await _line(peer, 30.0) == "connected"
            connected = time.monotonic()
            # The stuck handshake costs (almost) nothing ...
            cpu, wall = time.process_time(), time.monotonic()
            await asyncio.sleep(1.5)
            used = (time.process_time() - cpu) / (time.monotonic() - wall)
            print(f"{mode} peer in the handshake: owner process at {used:.4f} CPU-s/s")
            if UCX_OPTIONS["progress_mode"] == "blocking":  # in the other modes every ucxx wait polls
                assert used < BUDGET, f"the owner spins at {used:.2f} CPU-s/s on a stuck handshake"
            listener = local._listener
            assert listener is not None and listener.handshaking == 1, "measured outside the stuck handshake"
            # ... and holds up no other peer.
            link = await w.connect(descriptor)
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), SIZE)])
            assert torch.equal(src[:SIZE], dst)
            assert listener.handshaking == 1
            # After connect_timeout the owner closes the stuck connection (not before).
            while listener.handshaking:
                assert time.monotonic() - connected < DEADLINE + 10.0, "the stuck handshake was never given up"
                await asyncio.sleep(0.05)
            given_up = time.monotonic() - connected
            print(f"given up {given_up:.2f} s after the peer connected (connect_timeout={DEADLINE} s)")
            assert listener.handshakes_given_up == 1
            assert given_up > DEADLINE - 1.0  # the peer printed "connected" at most ~0.3 s after connecting
            if mode == "frozen":
                os.kill(peer.pid, signal.SIGCONT)  # it sends its half now: nothing of ours may receive it
            assert await _line(peer, 10.0) == "closed"
            # The owner is unharmed and still serves.
            src.fill_(7)
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), SIZE)])
            assert torch.equal(src[:SIZE], dst)
            await link.aclose()
