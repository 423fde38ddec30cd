"""A closed owner's listener never calls back into freed memory.

Each endpoint ucxx creates from a connection request keeps ucxx's C++ listener alive, so dropping the
plugin's ``UCXListener`` object at ``aclose()`` (which frees the data its connection callback reads) left a
listener that still accepted on the port and called back with freed data while such an endpoint lived
(kept by the graveyard after a served connection, or inside ucxx after a handshake given up with its
receive posted): a client of the old port then made ucxx log ``KeyError: 'cb_func'`` (found by a review;
the same before the plugin had its own listener). Now dead endpoints let go of the listener at close,
and a listener whose handshake was given up is kept with its data."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest
import torch
import ucxx
from aioembed.testing import region_of
from aioembed.transports.base import WriteOp
from aioembed.transports.registry import open_transport

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
