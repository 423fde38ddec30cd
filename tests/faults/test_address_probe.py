"""What a dropped sender's address says: real sockets on this host (no mocks)."""

from __future__ import annotations

import socket
import tempfile
from pathlib import Path

import pytest

from aioembed.control.address_probe import ProbeVerdict, _tcp_target, probe_address

pytestmark = pytest.mark.anyio


def _closed_port() -> int:
    """A port nothing listens on (bound and closed at once: refused until someone takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_listening_tcp_address_answers_and_a_closed_one_refuses() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        assert await probe_address(f"tcp://127.0.0.1:{port}", 5.0) is ProbeVerdict.ANSWERED
    assert await probe_address(f"tcp://127.0.0.1:{_closed_port()}", 5.0) is ProbeVerdict.REFUSED
    # A name: every address it resolves to must refuse (localhost may be ::1 and 127.0.0.1).
    assert await probe_address(f"tcp://localhost:{_closed_port()}", 5.0) is ProbeVerdict.REFUSED


async def test_a_frozen_listener_still_answers() -> None:
    """A process that is stopped (SIGSTOP) keeps its listening socket: its kernel completes the handshake from
    the backlog. Answering says nothing of the writes: not a proof that the sender is gone."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)  # nobody ever accept()s
        assert await probe_address(f"tcp://127.0.0.1:{srv.getsockname()[1]}", 5.0) is ProbeVerdict.ANSWERED


async def test_an_address_nothing_can_be_learnt_from() -> None:
    assert await probe_address("inproc://sender", 1.0) is ProbeVerdict.UNKNOWN
    assert await probe_address("tcp://no-such-host.invalid:5555", 5.0) is ProbeVerdict.NO_ANSWER


async def test_an_address_that_does_not_answer_in_time() -> None:
    """A listener whose backlog is full drops new SYNs (as a paused host does): no answer within the timeout.
    (Not an address routed nowhere: a firewall on the way may refuse on its behalf, as this sandbox's does.)"""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        held = []
        try:
            for _ in range(4):  # fill the accept queue (never accepted)
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", port))
                held.append(c)
            assert await probe_address(f"tcp://127.0.0.1:{port}", 0.5) is ProbeVerdict.NO_ANSWER
        finally:
            for c in held:
                c.close()


async def test_ipc_paths() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "sender.sock")
        assert await probe_address(f"ipc://{path}", 5.0) is ProbeVerdict.REFUSED  # no file
        with socket.socket(socket.AF_UNIX) as srv:
            srv.bind(path)
            srv.listen()
            assert await probe_address(f"ipc://{path}", 5.0) is ProbeVerdict.ANSWERED
        assert await probe_address(f"ipc://{path}", 5.0) is ProbeVerdict.REFUSED  # the file stays, nobody listens


def test_zeromq_tcp_address_forms() -> None:
    assert _tcp_target("10.0.0.5:5555") == ("10.0.0.5", 5555)
    assert _tcp_target("[::1]:5555") == ("::1", 5555)
    assert _tcp_target("eth0;enc-0.svc:7000") == ("enc-0.svc", 7000)
