"""The plugin changes the environment only in ways a running engine's threads survive.

The engine's threads call ``getenv()`` for every transfer (``MC_TCP_PROGRESS_TIMEOUT_SEC``,
``MC_TCP_STATUS_TIMEOUT_SEC``, ``MC_TCP_PROTO``), and ``getenv()`` takes no lock: adding a variable may
move the C environment array (glibc frees the old one) and removing one shifts the entries after it. The
plugin set ``MC_FORCE_TCP`` / ``MC_TRANSFER_TIMEOUT`` around each engine's start and removed them again,
also while other engines of the process ran. Now, while an engine exists, it only replaces values of
variables that exist, and a protocol that would need ``MC_FORCE_TCP`` added or removed is refused. The
endpoint's timeouts are taken when it opens, not read from ``os.environ`` on every write.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from aioembed.errors import ConfigError
from aioembed.transports.base import MemoryRegion, WriteOp
from aioembed.transports.tcp_orphans import orphan_retransmit_horizon

from aioembed_mooncake import MooncakeTransport
from aioembed_mooncake._engine import EngineSettings, start_engine

pytestmark = pytest.mark.anyio

TCP = {"protocol": "tcp", "hostname": "127.0.0.1"}


class _Mutations:
    """The C environment's changes (``os.environ`` goes through ``os.putenv`` / ``os.unsetenv``):
    ``(kind, name, value, existed)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, str, str | None, bool]] = []
        putenv, unsetenv = os.putenv, os.unsetenv

        def put(name: str | bytes, value: str | bytes) -> None:  # os.environ passes encoded names
            key, text = os.fsdecode(name), os.fsdecode(value)
            self.seen.append(("put", key, text, key in os.environ))
            putenv(name, value)

        def unset(name: str | bytes) -> None:
            key = os.fsdecode(name)
            self.seen.append(("unset", key, None, key in os.environ))
            unsetenv(name)

        monkeypatch.setattr(os, "putenv", put)
        monkeypatch.setattr(os, "unsetenv", unset)

    def structural(self) -> list[tuple[str, str, str | None, bool]]:
        """The changes that move or shift the environment array: a removal, or an added variable."""
        return [m for m in self.seen if m[0] == "unset" or not m[3]]


@pytest.mark.parametrize("first_timeout", [None, 10])
async def test_a_second_endpoint_with_other_options_adds_or_removes_no_variable(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, first_timeout: int | None) -> None:
    first = dict(TCP) if first_timeout is None else dict(TCP, transfer_timeout=first_timeout)
    async with await MooncakeTransport.open(first):
        had_timeout = "MC_TRANSFER_TIMEOUT" in os.environ
        mutations = _Mutations(monkeypatch)
        with caplog.at_level(logging.WARNING, logger="aioembed_mooncake"):
            async with await MooncakeTransport.open(dict(TCP, transfer_timeout=12)) as second:
                assert second.transfer_timeout == 12
        assert mutations.structural() == [], mutations.seen
        if not had_timeout:  # the engine's own timeout could not be given: said so
            assert any("MC_TRANSFER_TIMEOUT" in r.getMessage() and "not added" in r.getMessage()
                       for r in caplog.records), caplog.text


async def test_a_protocol_the_running_engines_cannot_share_is_refused_naming_force_tcp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    settings = EngineSettings(hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="rdma",
                              device_name="", transfer_timeout=None)
    async with await MooncakeTransport.open(TCP):
        mutations = _Mutations(monkeypatch)
        with pytest.raises(ConfigError, match=r"protocol='rdma' needs MC_FORCE_TCP unset.*MC_FORCE_TCP='1'"):
            start_engine(settings)
        assert mutations.seen == []
        assert os.environ.get("MC_FORCE_TCP") == "1"


async def test_writes_read_no_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    src = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(4096, dtype=torch.uint8)
    async with await MooncakeTransport.open(TCP) as a, await MooncakeTransport.open(TCP) as b:
        await a.register([MemoryRegion(src.data_ptr(), src.numel())])
        await b.register([MemoryRegion(dst.data_ptr(), dst.numel())])
        link = await a.connect(b.descriptor())
        expected = (a.transfer_timeout, a.progress_timeout, a.write_lifetime)

        reads: list[str] = []

        class Watched(dict[str, str]):
            def get(self, key: str, default: Any = None) -> Any:
                reads.append(key)
                return super().get(key, default)

            def __getitem__(self, key: str) -> str:
                reads.append(key)
                return super().__getitem__(key)

        monkeypatch.setattr(os, "environ", Watched(os.environ))
        for _ in range(3):
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr(), 4096)])
        assert torch.equal(src, dst)
        assert [k for k in reads if k.startswith("MC_")] == [], "read by the writes"
        # what the sender asks after every write (send_room: write_lifetime), and a failed write's message
        assert (a.transfer_timeout, a.progress_timeout, a.write_lifetime) == expected
        assert [k for k in reads if k.startswith("MC_")] == [], "read by the properties"
        await link.aclose()


def test_timeouts_are_parsed_as_the_engine_parses_them() -> None:
    from aioembed_mooncake._engine import engine_transfer_timeout, lane_timeout

    # transfer_engine_py.cpp: max(5, atoi(MC_TRANSFER_TIMEOUT)), 30 where unset
    assert [engine_transfer_timeout(v) for v in (None, "12", " 40s", "2", "x", "")] == [30, 12, 40, 5, 5, 5]
    # tcp_transport_session_impl.h: atoi(MC_TCP_PROGRESS_TIMEOUT_SEC) if positive, else 30
    assert [lane_timeout(v) for v in (None, "5", "60x", "0", "-3", "x")] == [30, 5, 60, 30, 30, 30]


def test_in_a_fresh_process_the_first_engine_sets_what_later_ones_swap() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_") or k == "MC_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("env_proc.py"))],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    none = dict.fromkeys(("MC_FORCE_TCP", "MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC",
                          "MC_TCP_STATUS_TIMEOUT_SEC"))
    assert out["start"] == none, out
    # The first engine: MC_FORCE_TCP stays (its threads run now), MC_TRANSFER_TIMEOUT rests at the
    # engine's default (unset before: the same for the engine), the lanes' timeouts are the first endpoint's.
    assert out["after_first"] == {"MC_FORCE_TCP": "1", "MC_TRANSFER_TIMEOUT": "30",
                                  "MC_TCP_PROGRESS_TIMEOUT_SEC": "8", "MC_TCP_STATUS_TIMEOUT_SEC": "8"}, out
    lifetime = max(32.0, orphan_retransmit_horizon() + 2.0)  # over TCP: what a closed socket still retransmits
    assert out["first"] == [8, 30, lifetime], out
    assert out["second"] == [12, 30, lifetime] and out["third"] == [30, 30, lifetime], out
    assert out["third_after_change"] == out["third"], out
    # Later endpoints only replaced values (the second's timeout for its construction, then back) ...
    assert all(kind == "put" and existed for kind, _, _, existed in out["mutations"]), out
    assert [m[1:3] for m in out["mutations"] if m[1] == "MC_TRANSFER_TIMEOUT"][:2] == [
        ["MC_TRANSFER_TIMEOUT", "12"], ["MC_TRANSFER_TIMEOUT", "30"]], out
    assert out["after_second"] == out["after_first"], out
    # ... and a protocol that would need MC_FORCE_TCP removed while engines run is refused.
    refused = out["rdma_while_running"]
    assert "MC_FORCE_TCP unset" in refused and "engine(s) of this process are running" in refused, out
    assert out["alive_after_close"] == 0, out


async def test_aclose_destroys_the_engine_while_the_endpoint_is_still_referenced() -> None:
    """The poller held the engine's bound ``transfer_check_status``, so ``aclose()`` left the engine (its
    threads, its listener on the rpc port) alive until the endpoint object itself was collected, and its
    slow destructor (about 1 s, holding the GIL) ran wherever that happened; the engine also still counted
    as running for the environment's rules (found by a review)."""
    import socket
    import weakref

    t = await MooncakeTransport.open(TCP)
    engine = weakref.ref(t._engine)
    port = t.rpc_port
    await t.aclose()
    assert engine() is None, "aclose() left the engine alive"  # and so no longer counted in _live_engines
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        pass  # its handshake listener is gone with it
    assert t.closed  # the endpoint itself is still referenced here


async def test_an_open_cancelled_once_the_engine_started_destroys_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """open() cancelled after its engine started (a sender's start under a deadline) left the engine to the
    garbage collector: its slow destructor (about 1 s holding the GIL) ran on the event loop wherever the last
    reference went, and the environment the plugin set for it (``MC_FORCE_TCP``) was never given back to the
    user, though no engine ran any more (found by a review)."""
    import socket
    import weakref

    import anyio.from_thread

    from aioembed_mooncake import _engine, transport

    assert _engine._engines_alive() == 0, "an engine of an earlier test is still alive"
    before = os.environ.get("MC_FORCE_TCP")
    started: list[Any] = []
    scope = anyio.CancelScope()

    def start_then_cancel(settings: EngineSettings) -> Any:
        out = start_engine(settings)
        started.append((weakref.ref(out.engine), out.rpc_port))
        anyio.from_thread.run_sync(scope.cancel)  # arrives at open()'s next checkpoint, the engine up
        return out

    monkeypatch.setattr(transport, "start_engine", start_then_cancel)
    with scope:
        await MooncakeTransport.open(TCP)
    assert scope.cancelled_caught and started
    engine, port = started[0]
    assert engine() is None, "the cancelled open() left its engine alive"
    assert _engine._engines_alive() == 0
    assert os.environ.get("MC_FORCE_TCP") == before, "the engine is gone, but the environment set for it stayed"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
        pass  # its handshake listener is gone with it


_RESTORED_SCRIPT = r"""
import os, subprocess, sys, anyio
os.environ.pop("MC_FORCE_TCP", None); os.environ.pop("MC_TRANSFER_TIMEOUT", None)
from aioembed_mooncake import MooncakeTransport
async def main():
    async with await MooncakeTransport.open({"protocol": "tcp", "hostname": "127.0.0.1", "transfer_timeout": 9}):
        pass
anyio.run(main)
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('MC_FORCE_TCP'))"],
                       capture_output=True, text=True, check=True).stdout.strip()
print(repr(os.environ.get("MC_FORCE_TCP")), repr(os.environ.get("MC_TRANSFER_TIMEOUT")), child)
"""


def test_the_environment_is_the_users_again_once_no_engine_exists() -> None:
    """Once every engine of the process is gone, the environment is the user's again: MC_FORCE_TCP=1 (or the
    user's MC_FORCE_TCP deleted, for protocol 'rdma') stayed for the rest of the process after the endpoint
    closed, and every child started later inherited it (the engine only tests whether it exists: a child's
    own Mooncake engine on RDMA was forced to TCP). Found by a review."""
    out = subprocess.run([sys.executable, "-c", _RESTORED_SCRIPT], capture_output=True, text=True, timeout=120,
                         check=True)
    last = out.stdout.strip().splitlines()[-1]
    assert last == "None None None", f"after close (process, MC_TRANSFER_TIMEOUT, child's MC_FORCE_TCP): {last}"
