"""The failure boundary: every fault reaches both sides as a typed error naming its cause, and the
sender keeps serving afterwards.

A plugin (here the MockTransport) may raise anything in ``connect``, ``write`` or ``register``; bad
metadata is refused by ``send()`` before a row moves, and the receiver learns why at once.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import anyio
import pytest
import torch

from aioembed import (
    AioembedError,
    EmbeddingReceiver,
    EmbeddingSender,
    InvalidRequest,
    TransferAborted,
    TransferConfig,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from aioembed.metrics import TransferObserver
from aioembed.testing import MockTransport
from aioembed.testing.mock import WriteFault

from ..session.conftest import LAYOUT, assert_same, make_request, room_fails_on_both_sides, wait_pools_free

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=1.0, input_timeout=2.5,
                     round_timeout=5.0, heartbeat_interval=0.2)


async def _serves(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str) -> None:
    src = make_request(1500, 9)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, room, src)
        got = await receiver.receive(room)
    assert_same(got.tensors, src)


@pytest.mark.parametrize("exc_type", [RuntimeError, ValueError, OSError])
@pytest.mark.parametrize("method", ["write", "register"])
async def test_a_foreign_exception_in_write_or_register_fails_the_room_on_both_sides(
        method: str, exc_type: type[Exception]) -> None:
    writer = MockTransport(raise_on={method: exc_type(f"engine says no in {method}")})
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        handle = receiver.start("r")
        with anyio.fail_after(5):
            while not sender.rooms_in_flight:  # the receiver asked first: it is told when send() fails
                await anyio.sleep(0.005)
        outcome: list[BaseException] = []

        async def send() -> None:
            try:
                await sender.send("r", make_request(1500, 1))
            except BaseException as exc:  # must be a TransferError, not an ExceptionGroup or the raw one
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferFailed) as at_receiver:
                await handle.result()
        (err,) = outcome
        assert isinstance(err, TransferFailed), repr(err)
        for text in (str(err), str(at_receiver.value)):  # both sides name the cause
            assert f"{exc_type.__name__}: engine says no in {method}" in text, text
        del writer.raise_on[method]
        await _serves(sender, receiver, "after")  # the sender still serves new rooms
        await wait_pools_free(sender, receiver)


@pytest.mark.parametrize("exc_type", [RuntimeError, ValueError, OSError])
async def test_a_foreign_exception_in_connect_is_named_on_both_sides(exc_type: type[Exception]) -> None:
    writer = MockTransport(raise_on={"connect": exc_type("engine says no in connect")})
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        outcome: list[BaseException] = []

        async def send() -> None:
            try:
                await sender.send("r", make_request(1500, 1))
            except BaseException as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferTimeout) as at_receiver:
                await receiver.receive("r")
        (err,) = outcome
        assert isinstance(err, TransferTimeout), repr(err)
        for text in (str(err), str(at_receiver.value)):
            assert f"{exc_type.__name__}: engine says no in connect" in text, text
        del writer.raise_on["connect"]
        await receiver.wait_connected(timeout=5)  # its HELLO is answered on the next try
        await _serves(sender, receiver, "after")


async def test_a_descriptor_the_transport_cannot_give_fails_rooms_with_its_cause_and_is_tried_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver's transport fails to describe itself for the HELLO (a NIXL agent's metadata, a UCX listener).
    The error left the connection's task: the connection closed, logged only as a background task's failure, and
    every room for that sender failed with "the connection ... was closed" and no cause; a transport that recovered
    was never tried again by that connection."""
    from aioembed.errors import TransportError
    from aioembed.session import connection

    monkeypatch.setattr(connection, "REFUSAL_RETRY", 0.3)
    flaky = MockTransport(raise_on={"descriptor": RuntimeError("agent metadata unavailable")})
    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport()) as sender, \
            EmbeddingReceiver(LAYOUT, CFG.replace(handshake_timeout=10.0), connect=sender.address,
                              transport=flaky) as receiver:
        for room in ("a", "b"):
            with anyio.fail_after(5):  # at once, not after the handshake timeout
                with pytest.raises(TransferFailed, match="cannot shake hands") as err:
                    await receiver.receive(room)
            assert isinstance(err.value.__cause__, TransportError), repr(err.value.__cause__)
            assert "agent metadata unavailable" in str(err.value)
        del flaky.raise_on["descriptor"]  # the transport recovered: the same connection shakes hands again
        conn = receiver._conns[sender.address]
        with anyio.fail_after(10):
            while not conn.ready:  # refused until the next handshake, a REFUSAL_RETRY later
                await anyio.sleep(0.05)
        await _serves(sender, receiver, "c")


async def test_a_link_that_fails_to_close_after_its_receiver_left_is_a_warning_not_a_bug(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Closing an endpoint to a receiver that is gone may fail in the plugin (UCX, NIXL). The sender closed such
    links in a bare background task, which logged the failure as an internal bug (ERROR, traceback)."""
    from aioembed.testing.mock import MockLink

    close, refused = MockLink.aclose, set()

    async def refuse(self: MockLink) -> None:  # the first close fails; the transport's own close ends it later
        if id(self) not in refused:
            refused.add(id(self))
            raise RuntimeError("endpoint already torn down")
        await close(self)

    monkeypatch.setattr(MockLink, "aclose", refuse)
    cfg = CFG.replace(heartbeat_interval=0.1)
    async with EmbeddingSender(LAYOUT, cfg, transport=MockTransport()) as sender:
        async with EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
            await _serves(sender, receiver, "r")
        def said(r: logging.LogRecord) -> bool:
            return "torn down" in r.getMessage() or (r.exc_info is not None and "torn down" in str(r.exc_info[1]))

        with caplog.at_level(logging.WARNING, logger="aioembed"):
            with anyio.fail_after(5):
                while not any(said(r) for r in caplog.records):
                    await anyio.sleep(0.02)  # the receiver left: its session ends, its link is closed
    (closing,) = [r for r in caplog.records if said(r)]
    assert closing.levelno == logging.WARNING and "closing the link" in closing.getMessage(), closing.getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


async def test_metadata_the_codec_refuses_is_refused_by_send_and_ends_the_room_at_once() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as sender, \
            EmbeddingReceiver(LAYOUT, CFG.replace(input_timeout=60.0), connect=sender.address) as receiver:
        handle = receiver.start("r")
        with anyio.fail_after(5):
            while sender.rooms_in_flight < 1:  # the receiver already asked for it
                await anyio.sleep(0.01)
        deep: object = 1
        for _ in range(20):
            deep = [deep]
        for bad in ({448: 1}, {"deep": deep}, {"x": object()}):
            with pytest.raises(InvalidRequest, match="metadata"):
                await sender.send("r", make_request(10, 1), bad)
        t0 = time.monotonic()
        with pytest.raises(TransferAborted, match=r"send\(\) refused the request: .*metadata"):
            await handle.result()
        assert time.monotonic() - t0 < 10.0  # at once, not after input_timeout (60 s)
        await _serves(sender, receiver, "after")
        await wait_pools_free(sender, receiver)


class _CudaMock(MockTransport):
    """A mock transport that says it moves CUDA memory (as NIXL, UCX and Mooncake do)."""

    def __init__(self) -> None:
        super().__init__()
        self.capabilities = dataclasses.replace(self.capabilities, cuda=True)


@pytest.mark.parametrize("registered", [False, True], ids=["own", "with-registered-buffers"])
async def test_a_tensor_on_a_device_no_transport_moves_is_refused_and_ends_the_room_at_once(registered: bool) -> None:
    """A transport that moves CUDA memory moves CPU and CUDA memory only: a field on another device (``meta`` here;
    ``xpu`` or ``mps`` elsewhere) is refused naming it, and a receiver that asked for the room learns at once. It
    was taken for CUDA memory: its pointer registered as ``cuda:0`` (a ``TransportError`` on address 0 for ``meta``),
    and the receiver waited for the input until its ``input_timeout``."""
    async with EmbeddingSender(LAYOUT, CFG, transport=_CudaMock()) as sender, \
            EmbeddingReceiver(LAYOUT, CFG.replace(input_timeout=60.0), connect=sender.address,
                              transport=MockTransport()) as receiver:
        if registered:
            await sender.register_sources(*LAYOUT.empty(64).values())
        handle = receiver.start("r")
        with anyio.fail_after(5):
            while sender.rooms_in_flight < 1:  # the receiver already asked for it
                await anyio.sleep(0.01)
        bad = dict(make_request(10, 1), embeddings=torch.empty(10, *LAYOUT["embeddings"].shape,
                                                                dtype=LAYOUT["embeddings"].dtype, device="meta"))
        with pytest.raises(InvalidRequest, match=r"room 'r': field 'embeddings' is on meta"):
            await sender.send("r", bad)
        t0 = time.monotonic()
        with pytest.raises(TransferAborted, match=r"send\(\) refused the request: .*meta"):
            await handle.result()
        assert time.monotonic() - t0 < 10.0  # at once, not after input_timeout (60 s)
        await _serves(sender, receiver, "after")
        assert sender.sources_held == 0


async def test_a_room_refused_while_being_sent_is_not_aborted() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address) as receiver:
        src = make_request(1500, 3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "r", src)
            with anyio.fail_after(5):
                while not sender.rooms_in_flight:
                    await anyio.sleep(0.001)
            with pytest.raises(InvalidRequest, match="already being sent"):
                await sender.send("r", src)
            got = await receiver.receive("r")
        assert_same(got.tensors, src)


async def test_send_never_leaks_an_exception_group() -> None:
    """Whatever fails inside the room's task group, send() raises one TransferError."""
    writer = MockTransport(raise_on={"write": KeyError("not even an OSError")})
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        async def receive() -> None:
            with pytest.raises(TransferError):
                await receiver.receive("r")

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            with pytest.raises(TransferError) as info:
                await sender.send("r", make_request(500, 4))
        assert not isinstance(info.value, BaseExceptionGroup)
        assert "KeyError: 'not even an OSError'" in str(info.value)


class _ConnectFailsOnce(MockTransport):
    """A plugin whose first connect fails (e.g. its NIC was still coming up)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures = 0

    async def connect(self, peer_descriptor: bytes) -> Any:
        if not self.failures:
            self.failures += 1
            raise RuntimeError("the NIC was still coming up")
        return await super().connect(peer_descriptor)


async def test_a_connect_that_fails_once_is_retried_at_once_not_after_the_handshake_timeout() -> None:
    cfg = CFG.replace(handshake_timeout=5.0)
    writer = _ConnectFailsOnce()
    async with EmbeddingSender(LAYOUT, cfg, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
        t0 = time.monotonic()
        await _serves(sender, receiver, "r")
        assert writer.failures == 1
        assert time.monotonic() - t0 < 1.0  # the refusal made the receiver say HELLO again soon


async def test_an_unexplained_write_failure_is_fenced_until_it_can_no_longer_land() -> None:
    """A foreign exception from write() says nothing about the bytes: they may still land, so the
    receiver keeps the blocks fenced until the transport's write lifetime passed (FENCE_RELEASE)."""
    lifetime = 1.0
    writer = MockTransport(raise_on={"write": RuntimeError("engine lost track of the transfer")},
                           write_lifetime=lifetime)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await room_fails_on_both_sides(sender, receiver, "r", "engine lost track")
        assert receiver.allocator.stats.fenced > 0  # at once: the write may still land
        assert receiver.fenced_blocks.get("write_failed")
        t0 = time.monotonic()
        with anyio.fail_after(lifetime + 3):
            await receiver.allocator.wait_all_free()
        assert time.monotonic() - t0 >= lifetime * 0.8  # not before the lifetime (of our running time)
        del writer.raise_on["write"]
        await _serves(sender, receiver, "after")  # the sender kept serving throughout


class _LifetimeUnknown(MockTransport):
    """A plugin whose ``write_lifetime`` (or ``orphan_lifetime``) raises, or says NaN, once ``broken``."""

    broken: str | None = None

    def _lifetime(self) -> float:
        if self.broken == "raises":
            raise RuntimeError("engine handle gone")
        return math.nan if self.broken == "nan" else 1.0

    write_lifetime = orphan_lifetime = property(_lifetime)  # type: ignore[assignment]


@pytest.mark.parametrize("known", [False, True], ids=["never-known", "known-before"])
@pytest.mark.parametrize("broken", ["raises", "nan"])
async def test_a_write_lifetime_the_plugin_cannot_say_keeps_a_failed_write_fenced(
        broken: str, known: bool, caplog: pytest.LogCaptureFixture) -> None:
    """A failed write that may still land is recorded with the plugin's write lifetime. A lifetime the plugin
    cannot give (it raises, or is NaN) is the last one it gave, or forever: before, the exception skipped the record,
    the room told the receiver its blocks were quiet (a plain FAILED STATUS), and a late landing found them freed."""
    landing: list[WriteFault] = []

    def late(call: Any) -> WriteFault | None:
        if landing:
            return None  # only the first write fails
        fault = WriteFault(error=RuntimeError("NIC error"), land_after=0.5)
        landing.append(fault)
        return fault

    writer = _LifetimeUnknown(cancel_safe_writes=False, faults=late)
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address,
                              transport=MockTransport(cancel_safe_writes=False)) as receiver:
        await receiver.wait_connected()
        if known:
            assert sender._transport is not None and sender._transport.write_lifetime == 1.0  # read once: kept
        writer.broken = broken
        with caplog.at_level(logging.WARNING, logger="aioembed.transports"):
            await room_fails_on_both_sides(sender, receiver, "r", "NIC error")
            assert receiver.allocator.stats.fenced > 0  # not freed while the write may land
            landed = await anyio.to_thread.run_sync(landing[0].landed.wait, 3.0)
        assert landed and not landing[0].refused.is_set()  # it did land, later, into blocks still fenced
        assert receiver.allocator.stats.fenced > 0
        said = "the last value it gave (1.0 s)" if known else "taken as forever"
        assert any("write_lifetime" in r.getMessage() and said in r.getMessage() for r in caplog.records)
        writer.broken = None
        await _serves(sender, receiver, "after")  # the sender goes on serving, into other blocks
        if known:  # the write retired 1 s after its failure: FENCE_RELEASE gave the blocks back
            await wait_pools_free(sender, receiver)
        else:  # on the sender's books for the sender's life: its blocks stay fenced
            assert sender.writes_in_flight == 1 and receiver.allocator.stats.fenced > 0


class _CannotSayWhatItReads(MockTransport):
    registrations = 0

    def reads_unregistered(self, device: str) -> bool:
        raise RuntimeError("engine not ready")

    async def register(self, regions: Any) -> None:
        self.registrations += 1
        await super().register(regions)


async def test_a_plugin_that_cannot_say_whether_it_reads_unregistered_sources_gets_them_registered(
        caplog: pytest.LogCaptureFixture) -> None:
    """The boundary turned the plugin's exception into a TransportError raised out of send(): no room named, and
    the rank that asked not told. Registering is what every transport takes: the room goes through."""
    writer = _CannotSayWhatItReads()
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        before = writer.registrations
        with caplog.at_level(logging.WARNING, logger="aioembed.transports"):
            await _serves(sender, receiver, "r")
        assert writer.registrations > before  # its sources were registered for the write
        assert any("reads_unregistered('cpu') raised RuntimeError: engine not ready" in r.getMessage()
                   for r in caplog.records)
        await _serves(sender, receiver, "again")
        await wait_pools_free(sender, receiver)


class _Indescribable(MockTransport):
    @property  # type: ignore[override]
    def capabilities(self) -> Any:
        raise RuntimeError("capabilities not known before the engine starts")

    @capabilities.setter
    def capabilities(self, value: Any) -> None:
        pass  # MockTransport sets them at construction


async def test_a_plugin_whose_capabilities_raise_fails_to_open_with_a_transport_error() -> None:
    """Read unguarded, the plugin's own exception came out of ``__aenter__``; opened by name, its endpoint was left
    open."""
    from aioembed.errors import TransportError
    from aioembed.transports.boundary import open_guarded

    with pytest.raises(TransportError, match="reading its name and capabilities raised RuntimeError"):
        async with EmbeddingSender(LAYOUT, CFG, transport=_Indescribable()):
            pass
    opened: list[_Indescribable] = []

    class Opens(_Indescribable):
        @classmethod
        async def open(cls, options: Any) -> Any:
            opened.append(cls())
            return opened[-1]

    with pytest.raises(TransportError, match="capabilities not known"):
        await open_guarded(Opens, {})
    assert len(opened) == 1 and opened[0].closed  # closed, not left registered with its engine


class _RaisingObserver(TransferObserver):
    """Every hook raises (a metrics backend that is down)."""

    def __init__(self) -> None:
        self.calls = 0

    def _boom(self, **_: Any) -> None:
        self.calls += 1
        raise ValueError("metrics backend down")

    room_finished = round_finished = sender_room_finished = rows_inline = _boom
    blocks_fenced = fence_released = sender_closed = _boom


async def test_an_observer_that_raises_breaks_no_room(caplog: pytest.LogCaptureFixture) -> None:
    """The caller's observer is called amid the sessions' bookkeeping (a room's end, a fence applied to the pool).
    Its exceptions are logged and dropped: rooms succeed and free everything, fences come and go. Before, a
    ``send()`` whose rows had landed raised the observer's ``ValueError`` and kept its room and source for good."""
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=1.0, input_timeout=2.5,
                         round_timeout=5.0, heartbeat_interval=0.2, staging_tokens=0)
    seen_send, seen_receive = _RaisingObserver(), _RaisingObserver()
    writer = MockTransport(raise_on={"write": RuntimeError("engine lost track of the transfer")},
                           write_lifetime=0.3)
    with caplog.at_level(logging.WARNING, logger="aioembed.metrics"):
        async with EmbeddingSender(LAYOUT, cfg, transport=writer, observer=seen_send) as sender, \
                EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport(),
                                  observer=seen_receive) as receiver:
            # A failed write that may land: the receiver fences its blocks and frees them later (both hooks raise).
            await room_fails_on_both_sides(sender, receiver, "bad", "engine lost track")
            del writer.raise_on["write"]
            for room in ("a", "b", "a"):  # "a" again: refused ("already being sent") if the sender still held it
                await _serves(sender, receiver, room)
            await wait_pools_free(sender, receiver)
            assert sender.rooms_in_flight == 0 and sender.sources_held == 0
    assert seen_send.calls >= 3 and seen_receive.calls >= 5  # every hook was called, and each raised
    assert sender.observer.failures == seen_send.calls  # type: ignore[attr-defined]
    assert any("metrics backend down" in r.getMessage() for r in caplog.records)


async def test_a_foreign_exception_preparing_the_rows_fails_send_and_tells_the_receiver_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch running out of memory while ``send()`` makes the rows contiguous (or stages them) is a
    ``TransferFailed`` naming the room, not a raw ``RuntimeError``; a receiver already waiting is told at once."""
    async with EmbeddingSender(LAYOUT, CFG, transport=MockTransport()) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        handle = receiver.start("r")
        with anyio.fail_after(5):
            while not sender.rooms_in_flight:  # the receiver asked first
                await anyio.sleep(0.005)

        async def out_of_memory(*_: Any, **__: Any) -> Any:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

        monkeypatch.setattr(sender, "_input_of", out_of_memory)
        t0 = time.monotonic()
        with pytest.raises(TransferFailed, match="'r': preparing the request's rows failed: RuntimeError: CUDA out") \
                as info:
            await sender.send("r", make_request(1500, 1))
        assert isinstance(info.value.__cause__, RuntimeError)
        with pytest.raises(TransferAborted, match="out of memory"):
            await handle.result()
        assert time.monotonic() - t0 < CFG.input_timeout  # told at once, not at its input timeout
        monkeypatch.undo()
        await _serves(sender, receiver, "after")


async def test_send_after_close_says_the_sender_is_closed() -> None:
    sender = EmbeddingSender(LAYOUT, CFG, transport=MockTransport())
    with pytest.raises(AioembedError, match="not running: use `async with"):
        await sender.send("r", make_request(16, 1))
    async with sender:
        pass
    with pytest.raises(AioembedError, match="closing or closed"):
        await sender.send("r", make_request(16, 1))
