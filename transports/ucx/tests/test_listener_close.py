"""A closed owner's listener never calls back into freed memory.

Each endpoint ucxx creates from a connection request keeps ucxx's C++ listener alive, so dropping the
plugin's ``UCXListener`` object at ``aclose()`` (which frees the data its connection callback reads) left a
listener that still accepted on the port and called back with freed data while such an endpoint lived
(kept by the graveyard after a served connection, or inside ucxx after a handshake given up with its
receive posted): a client of the old port then made ucxx log ``KeyError: 'cb_func'`` (found by a review;
the same before the plugin had its own listener). Now dead endpoints let go of the listener at close,
and a listener whose handshake was given up is kept with its data.

A handshake given up (at ``connect_timeout``, or cut short by the close) kept the port listening after the
owner closed, for as long as the process lived: ``close_blocking`` on its endpoint, with a stream receive
posted that UCX cannot cancel, left the endpoint, and with it ucxx's listener, referenced inside ucxx."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

import pytest
import torch
import ucxx
from aioembed.testing import region_of
from aioembed.transports.base import WriteOp
from aioembed.transports.registry import open_transport

from aioembed_ucx import _listener

from .conftest import UCX_OPTIONS, ucx_transport
from .test_handshake import _line, handshake_peer

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # ucxx is asyncio-only


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("case", ["served", "stuck"])
async def test_a_client_of_a_closed_owners_port_meets_no_freed_callback(case: str) -> None:
    said = _Said()
    logging.getLogger("ucx").addHandler(said)
    owner = await open_transport("ucx", dict(UCX_OPTIONS, connect_timeout=30.0))
    writers = []
    try:
        dst = torch.zeros(4096, dtype=torch.uint8)
        await owner.register([region_of(dst)])
        descriptor = owner.descriptor()  # listens from here
        port = ucx_transport(owner).port
        if case == "served":  # an ordinary connection, up when the owner closes
            w = await open_transport("ucx", UCX_OPTIONS)
            writers.append(w)
            src = torch.ones(4096, dtype=torch.uint8)
            await w.register([region_of(src)])
            link = await w.connect(descriptor)
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])
            assert torch.equal(dst, src)
        with contextlib.ExitStack() as stack:
            if case == "stuck":  # a peer stuck in the handshake when the owner closes
                peer = stack.enter_context(handshake_peer(port, "silent"))
                assert await _line(peer, 30) == "connected"
            await owner.aclose()
            await asyncio.sleep(0.3)
            client = None
            with contextlib.suppress(Exception):  # nobody serves the old port: refused, or it times out
                client = await asyncio.wait_for(ucxx.create_endpoint("127.0.0.1", port, connect_timeout=2.0), 5.0)
            assert client is None, "a closed owner's port accepted a connection"
            bad = [m for m in said.lines if "listener callback" in m]
            assert not bad, bad
    finally:
        logging.getLogger("ucx").removeHandler(said)
        await owner.aclose()
        for w in writers:
            await w.aclose()


def _listening(port: int) -> bool:
    """Whether a socket of this process listens on ``port`` (``/proc/self/net/tcp*`` lists the namespace's)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(target[len("socket:["):-1])
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()  # sl, local address, remote address, state (0A: LISTEN), ..., inode
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in mine:
                    return True
    return False


@pytest.mark.parametrize("case", ["given_up", "closing"])
async def test_a_closed_owner_stops_listening_after_a_handshake_it_gave_up(case: str) -> None:
    """``given_up``: the owner closed a connection stuck in the handshake at ``connect_timeout``, then closes;
    ``closing``: the owner closes while the handshake is stuck."""
    deadline = 2.0
    owner = await open_transport("ucx", dict(UCX_OPTIONS, connect_timeout=deadline))
    retired = len(_listener._RETIRED)
    try:
        owner.descriptor()  # listens from here
        local = ucx_transport(owner)
        port, listener = local.port, local._listener
        assert port is not None and listener is not None and _listening(port)
        with handshake_peer(port, "silent") as peer:
            assert await _line(peer, 30) == "connected"
            if case == "given_up":
                start = time.monotonic()
                while not listener.handshakes_given_up:
                    assert time.monotonic() - start < deadline + 10.0, "the stuck handshake was never given up"
                    await asyncio.sleep(0.05)
                assert await _line(peer, 10) == "closed"
                assert _listening(port)  # the owner is open: it still listens
            else:
                assert listener.handshaking == 1
            await owner.aclose()
            assert not _listening(port), f"the closed owner's port {port} still listens ({case} handshake)"
            assert len(_listener._RETIRED) == retired, "the closed listener was kept for an endpoint ucxx holds"
    finally:
        await owner.aclose()
