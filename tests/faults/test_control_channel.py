"""The control channel: one peer at its high-water mark neither blocks frames to the others nor makes
the I/O task spin."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest
import zmq

from aioembed.control.channel import ControlSocket
from aioembed.errors import AioembedError
from aioembed.testing.event_loops import anyio_backend_fixture

pytestmark = pytest.mark.anyio

FRAME = b"x" * (64 << 10)


@asynccontextmanager
async def router_with_two_peers(
    bundles: bool = False,
) -> AsyncIterator[tuple[ControlSocket, zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 4), (zmq.SNDBUF, 65536), (zmq.ROUTER_MANDATORY, 1)):
        router.setsockopt(opt, value)
    router.bind("tcp://127.0.0.1:0")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    peers = []
    for name in (b"stuck", b"healthy"):
        d = ctx.socket(zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.RCVHWM, 4), (zmq.RCVBUF, 65536), (zmq.ROUTING_ID, name)):
            d.setsockopt(opt, value)
        d.connect(address)
        peers.append(d)
    hello: list[bytes] = []
    chan = ControlSocket(router, lambda frames: hello.append(frames[0]), name="test-router", routed=True,
                         bundles=bundles)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            for d in peers:
                d.send(b"hi")  # the router learns both identities
            with anyio.fail_after(5):
                while len(hello) < 2:
                    await anyio.sleep(0.01)
            yield chan, peers[0], peers[1]
            tg.cancel_scope.cancel()
    finally:
        chan.close()
        for d in peers:
            d.close(linger=0)
        ctx.term()


def _recv_all(sock: zmq.Socket[bytes]) -> int:
    n = 0
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1


# The control channel watches ZeroMQ's edge-triggered descriptor: a selector on asyncio, libuv on uvloop.
anyio_backend = anyio_backend_fixture()


async def test_a_peer_at_its_high_water_mark_blocks_nobody_and_nothing_spins() -> None:
    async with router_with_two_peers() as (chan, stuck, healthy):
        for _ in range(300):  # far more than HWM + socket buffers: the stuck peer never reads
            chan.send([b"stuck", FRAME])
        await anyio.sleep(0.3)
        assert chan.blocked_peers == 1 and chan.queued > 0
        for _ in range(100):
            chan.send([b"healthy", b"small"])
        got = 0
        with anyio.fail_after(5):
            while got < 100:
                got += _recv_all(healthy)
                await anyio.sleep(0.01)
        # While the stuck peer stays stuck, the I/O task sleeps between retries: no busy loop.
        cpu0, wall0 = time.process_time(), time.monotonic()
        await anyio.sleep(2.0)
        cpu = time.process_time() - cpu0
        assert cpu < 0.4 * (time.monotonic() - wall0), f"{cpu:.2f} CPU-s in 2 s: the I/O task spins"
        assert chan.blocked_peers == 1
        # Once it reads, everything queued for it arrives, in order, and the outbox drains.
        received = 0
        with anyio.fail_after(20):
            while received < 300:
                received += _recv_all(stuck)
                await anyio.sleep(0.005)
            await chan.drain()
        assert chan.queued == 0 and chan.blocked_peers == 0


async def test_a_drain_ends_when_the_socket_closes_with_frames_still_queued() -> None:
    """The sides close their channel once its I/O task has stopped (``drain()`` first, under a timeout): a drain
    still waiting then, or called later, waited until its caller's timeout for frames that will never go."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 4), (zmq.SNDBUF, 65536), (zmq.ROUTER_MANDATORY, 1)):
        router.setsockopt(opt, value)
    router.bind("tcp://127.0.0.1:0")
    stuck = ctx.socket(zmq.DEALER)
    for opt, value in ((zmq.LINGER, 0), (zmq.RCVHWM, 4), (zmq.RCVBUF, 65536), (zmq.ROUTING_ID, b"stuck")):
        stuck.setsockopt(opt, value)
    stuck.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    stuck.send(b"hi")
    assert await anyio.to_thread.run_sync(_wire_messages, router, 1) == [[b"stuck", b"hi"]]
    chan = ControlSocket(router, lambda frames: None, name="test-router", routed=True)
    try:
        for _ in range(300):  # the peer never reads: most of these stay queued
            chan.send([b"stuck", FRAME])
        assert chan.queued > 0
        ended = anyio.Event()

        async def drain() -> None:
            await chan.drain()
            ended.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            await anyio.sleep(0.05)
            assert not ended.is_set()
            chan.close()  # they will never go now
            with anyio.fail_after(2):
                await ended.wait()
        with anyio.fail_after(2):
            await chan.drain()  # and a later one returns at once
        assert chan.queued == 0
    finally:
        chan.close()
        stuck.close(linger=0)
        ctx.term()


async def test_the_outbox_limit_is_per_peer() -> None:
    from aioembed.errors import AioembedError

    async with router_with_two_peers() as (chan, _stuck, healthy):
        chan._max_outbox = 50
        with pytest.raises(AioembedError, match="not reading"):
            for _ in range(500):
                chan.send([b"stuck", FRAME])
        chan.send([b"healthy", b"still fine"])  # another peer is not refused
        with anyio.fail_after(5):
            while not _recv_all(healthy):
                await anyio.sleep(0.01)


# -- bundles: a burst of messages to one peer goes as few ZeroMQ messages ----------------------------


def _bare_router_and_dealer(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A bound ROUTER and a DEALER (routing id ``b"dealer"``) connected to it."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"dealer")
    dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    return router, dealer


@asynccontextmanager
async def dealer_to_raw_router() -> AsyncIterator[tuple[ControlSocket, zmq.Socket[bytes], list[list[bytes]]]]:
    """A DEALER wrapped in a ControlSocket (its I/O task running), connected to a bare ROUTER."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = _bare_router_and_dealer(ctx)
    handled: list[list[bytes]] = []
    chan = ControlSocket(dealer, handled.append, name="test-dealer", bundles=True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            chan.send([b"hello"])  # the ROUTER learns the DEALER's identity (it drops frames to unknown ones)
            assert await anyio.to_thread.run_sync(_wire_messages, router, 1) == [[b"dealer", b"hello"]]
            router.send_multipart([b"dealer", b"welcome"])
            with anyio.fail_after(5):
                while not handled:  # the I/O task ran after the last send: the next lone one goes at once
                    await anyio.sleep(0.005)
            assert handled == [[b"welcome"]]
            handled.clear()
            chan.sent = chan.received = 0
            yield chan, router, handled
            tg.cancel_scope.cancel()
    finally:
        chan.close()
        router.close(linger=0)
        ctx.term()


def _wire_messages(sock: zmq.Socket[bytes], count: int, timeout_ms: int = 5000) -> list[list[bytes]]:
    """``count`` ZeroMQ messages as they came (a bundle is one, with a frame per message), blocking."""
    out = []
    while len(out) < count:
        assert sock.poll(timeout_ms, zmq.POLLIN), f"only {len(out)} of {count} ZeroMQ messages came"
        out.append(sock.recv_multipart())
    return out


async def test_a_burst_goes_as_bundles_in_order_and_a_lone_message_at_once() -> None:
    async with dealer_to_raw_router() as (chan, router, _):
        chan.send([b"first"])
        # Handed to ZeroMQ inside send(): it arrives while this task never yields to the I/O task.
        assert _wire_messages(router, 1) == [[b"dealer", b"first"]]
        for i in range(150):  # one loop turn: the first went at once above, so all of these queue
            chan.send([b"m%d" % i])
        assert chan.queued == 150
        wire = await anyio.to_thread.run_sync(_wire_messages, router, 3)
        assert [len(m) - 1 for m in wire] == [64, 64, 22]  # bundles of at most 64 behind the identity
        assert [f for m in wire for f in m[1:]] == [b"m%d" % i for i in range(150)]
        assert chan.sent == 151 and chan.bundles_sent == 3 and chan.queued == 0
        chan.send([b"again"])  # the I/O task ran (it sent the bundles): a lone message goes at once again
        assert _wire_messages(router, 1) == [[b"dealer", b"again"]]


async def test_a_bundle_stays_under_its_byte_cap() -> None:
    big = b"x" * (400 << 10)
    async with dealer_to_raw_router() as (chan, router, _):
        chan.send([b"lone"])
        for _ in range(7):
            chan.send([big])
        chan.send([b"y" * (2 << 20)])  # larger than the cap alone: goes alone
        wire = await anyio.to_thread.run_sync(_wire_messages, router, 6)
        assert [len(m) - 1 for m in wire] == [1, 2, 2, 2, 1, 1]
        assert all(sum(len(f) for f in m[1:]) <= (1 << 20) for m in wire[:-1])
        assert wire[-1][1] == b"y" * (2 << 20)


async def test_received_bundles_are_handed_over_one_message_at_a_time() -> None:
    async with dealer_to_raw_router() as (_chan, router, handled):
        router.send_multipart([b"dealer", b"a", b"b", b"c"])
        router.send_multipart([b"dealer", b"d"])
        with anyio.fail_after(5):
            while len(handled) < 4:
                await anyio.sleep(0.01)
        assert handled == [[b"a"], [b"b"], [b"c"], [b"d"]]
        assert _chan.received == 4


async def test_a_bundle_over_the_byte_cap_is_dropped_and_later_messages_go_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """Peers bundle several messages only up to 1 MiB together; a larger one (64 frames of a few MiB: each within
    ZeroMQ's per-frame limit) was decoded whole in one turn of the loop."""
    async with dealer_to_raw_router() as (_chan, router, handled):
        with caplog.at_level(logging.WARNING):
            router.send_multipart([b"dealer", b"x" * (600 << 10), b"y" * (600 << 10)])
            router.send_multipart([b"dealer", b"z" * (2 << 20)])  # one message over the cap: alone, as peers send it
            router.send_multipart([b"dealer", b"a", b"b"])
            with anyio.fail_after(5):
                while len(handled) < 3:
                    await anyio.sleep(0.01)
        assert handled == [[b"z" * (2 << 20)], [b"a"], [b"b"]]
        assert any("dropped a bundle of 2 messages" in r.getMessage() for r in caplog.records)


async def test_a_router_bundles_per_peer_and_splits_what_it_receives() -> None:
    async with router_with_two_peers(bundles=True) as (chan, stuck, healthy):
        got: list[list[bytes]] = []
        chan._on_frames = got.append
        for i in range(10):  # interleaved: each peer gets its own messages, in order
            chan.send([b"stuck", b"s%d" % i])
            chan.send([b"healthy", b"h%d" % i])
        for peer, name in ((stuck, b"s"), (healthy, b"h")):
            wire = await anyio.to_thread.run_sync(_wire_messages, peer, 2)
            assert [len(m) for m in wire] == [1, 9]
            assert [f for m in wire for f in m] == [name + b"%d" % i for i in range(10)]
        assert chan.bundles_sent == 2
        stuck.send_multipart([b"p", b"q"])  # a DEALER's bundle: the ROUTER hands each with the identity
        with anyio.fail_after(5):
            while len(got) < 2:
                await anyio.sleep(0.01)
        assert got == [[b"stuck", b"p"], [b"stuck", b"q"]]


async def test_a_message_must_be_one_payload_frame() -> None:
    from aioembed.errors import AioembedError

    async with dealer_to_raw_router() as (chan, _router, _):
        with pytest.raises(AioembedError, match=r"a message is \[payload\], got 2 frames"):
            chan.send([b"a", b"b"])
    async with router_with_two_peers(bundles=True) as (rchan, _stuck, _healthy):
        with pytest.raises(AioembedError, match=r"a message is \[identity, payload\], got 1 frames"):
            rchan.send([b"stuck"])


async def test_without_bundles_multipart_messages_go_and_come_whole() -> None:
    """A monitor socket's events are two frames: such a channel neither bundles nor splits."""
    async with router_with_two_peers() as (chan, stuck, _healthy):
        got: list[list[bytes]] = []
        chan._on_frames = got.append
        for i in range(5):
            chan.send([b"stuck", b"a%d" % i, b"b%d" % i])
        wire = await anyio.to_thread.run_sync(_wire_messages, stuck, 5)
        assert wire == [[b"a%d" % i, b"b%d" % i] for i in range(5)]
        assert chan.bundles_sent == 0
        stuck.send_multipart([b"p", b"q"])
        with anyio.fail_after(5):
            while not got:
                await anyio.sleep(0.01)
        assert got == [[b"stuck", b"p", b"q"]]


async def test_once_the_io_task_stopped_a_message_goes_at_once_and_is_not_stranded() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = _bare_router_and_dealer(ctx)
    chan = ControlSocket(dealer, lambda frames: None, name="test-dealer", bundles=True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            await anyio.sleep(0.05)
            chan.send([b"before"])  # at once; the next one to this peer would wait for the I/O task
            tg.cancel_scope.cancel()
        chan.send([b"after"])  # no I/O task any more (an owner closing): it must not wait for one
        assert chan.queued == 0
        wire = await anyio.to_thread.run_sync(_wire_messages, router, 2)
        assert wire == [[b"dealer", b"before"], [b"dealer", b"after"]]
    finally:
        chan.close()
        router.close(linger=0)
        ctx.term()


async def test_a_send_zeromq_refuses_does_not_leave_arrived_input_unread() -> None:
    """A send to a peer that left fails (``EHOSTUNREACH``, ``ROUTER_MANDATORY``) after libzmq ran its pending
    commands, which consumes the descriptor's edge of a message that arrived meanwhile. The failed send did not
    look at ``zmq.EVENTS`` again: the I/O task slept on with the message queued (a receiver's HELLO left
    unanswered, for good if no later send went through)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = _bare_router_and_dealer(ctx)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    got: list[bytes] = []
    chan = ControlSocket(router, lambda frames: got.append(frames[1]), name="test-router", routed=True,
                         bundles=True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            dealer.send(b"first")
            with anyio.fail_after(5):
                while not got:
                    await anyio.sleep(0.01)
            await anyio.sleep(0.1)  # the I/O task waits for the descriptor now
            dealer.send(b"hello")
            time.sleep(0.2)  # noqa: ASYNC251 (the loop is busy; ZeroMQ takes the message in meanwhile)
            chan.send([b"\x00a-receiver-that-left", b"status"])  # refused: dropped and logged
            with anyio.move_on_after(3):
                while len(got) < 2:
                    await anyio.sleep(0.01)
            waiting = bool(router.get(zmq.EVENTS) & zmq.POLLIN)
            assert got == [b"first", b"hello"], f"handled {got}; input waiting: {waiting}"
            tg.cancel_scope.cancel()
    finally:
        chan.close()
        dealer.close(linger=0)
        ctx.term()


def test_a_flood_is_handled_a_batch_at_a_time_and_an_oversized_bundle_is_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    """Between batches the I/O task yields. A batch counted ZeroMQ messages, not the messages bundled in
    them, and a bundle had no bound: one 16 MiB message of tiny frames held the loop for all of them."""
    from aioembed.control.channel import _BUNDLE_MAX, _RECV_BATCH

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = _bare_router_and_dealer(ctx)
    handled: list[list[bytes]] = []
    chan = ControlSocket(dealer, handled.append, name="test-dealer", bundles=True)  # no I/O task: _drain by hand
    try:
        dealer.send(b"hello")
        identity, _ = router.recv_multipart()
        caplog.set_level(logging.DEBUG, logger="aioembed")
        for _ in range(3):  # over the bound: dropped, one WARNING for all of them (the others at DEBUG)
            router.send_multipart([identity, *[b"x"] * (_BUNDLE_MAX + 1)])
        for _ in range(2 * _RECV_BATCH // _BUNDLE_MAX):
            router.send_multipart([identity, *[b"y"] * _BUNDLE_MAX])
        assert dealer.poll(5000)
        deadline = time.monotonic() + 5
        while len(handled) < 2 * _RECV_BATCH and time.monotonic() < deadline:
            before = len(handled)
            more = chan._drain()
            assert len(handled) - before <= _RECV_BATCH + _BUNDLE_MAX - 1  # one batch, then back to the loop
            if len(handled) < 2 * _RECV_BATCH:
                assert more or dealer.poll(100)
        assert len(handled) == 2 * _RECV_BATCH and all(m == [b"y"] for m in handled)
        dropped = [r.levelno for r in caplog.records if "dropped a ZeroMQ message of" in r.getMessage()]
        assert dropped == [logging.WARNING, logging.DEBUG, logging.DEBUG], dropped
    finally:
        chan.close()
        router.close(linger=0)
        ctx.term()


def test_a_batch_also_ends_at_its_byte_budget() -> None:
    """Large frames cost time by their size: a batch of them ends once it received ``_RECV_BATCH_BYTES``, not
    only after ``_RECV_BATCH`` messages (40 valid 5.7 MB frames held a receiver's loop for 13 s)."""
    from aioembed.control.channel import _RECV_BATCH_BYTES

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, dealer = _bare_router_and_dealer(ctx)
    handled: list[list[bytes]] = []
    chan = ControlSocket(dealer, handled.append, name="test-dealer", bundles=True)  # no I/O task: _drain by hand
    big = b"z" * (1 << 20)
    count = 3 * _RECV_BATCH_BYTES // len(big)
    try:
        dealer.send(b"hello")
        identity, _ = router.recv_multipart()
        for _ in range(count):
            router.send_multipart([identity, big])
        deadline = time.monotonic() + 5
        batches = []
        while len(handled) < count and time.monotonic() < deadline:
            if not dealer.poll(100):
                continue
            before = len(handled)
            chan._drain()
            batches.append(len(handled) - before)
        assert len(handled) == count and all(m == [big] for m in handled)
        assert max(batches) <= _RECV_BATCH_BYTES // len(big), batches  # the budget ends each batch
    finally:
        chan.close()
        router.close(linger=0)
        ctx.term()


async def test_closing_the_socket_under_its_running_io_task_ends_the_task_cleanly() -> None:
    """``close()`` while :meth:`ControlSocket.run` waits on the socket's FD (an owner that closes before it
    stopped the task, or a task group still unwinding): the task returns, raising nothing, on every loop (on uvloop
    the wait on the closed FD raised ENOTSOCK in the task, which took its task group down)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    got: list[list[bytes]] = []
    chan = ControlSocket(router, got.append, name="test-router", routed=True)
    try:
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(chan.run)
                await anyio.sleep(0.05)  # the task is waiting on the FD now
                chan.close()
            # run() returned by itself: the task group would have waited for ever otherwise
        assert chan.receive_pending() == 0  # a closed socket has nothing pending, and says so without raising
        with pytest.raises(AioembedError, match="test-router is closed"):
            chan.send([b"peer", b"late"])
        assert got == []
    finally:
        chan.close()
        ctx.term()


@pytest.mark.parametrize("bundles", [False, True], ids=["messages", "one-bundle"])
async def test_a_handler_closing_its_channel_gets_nothing_after_and_the_io_task_ends(bundles: bool) -> None:
    """A frame handler that closes its own channel (a side shutting down on a peer's message): the I/O task stops
    receiving at once and returns; the messages behind it, sent apart or bundled with it (the sides' channels
    bundle), are neither handed to the closed channel's handler nor read from the closed socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    got: list[bytes] = []

    def handle(frames: list[bytes]) -> None:
        got.append(frames[-1])
        if frames[-1] == b"bye":
            chan.close()

    chan = ControlSocket(router, handle, name="test-router", routed=True, bundles=bundles)
    try:
        payloads = [b"one", b"bye", b"after"]
        if bundles:
            peer.send_multipart(payloads)  # one bundle of three messages
        else:
            for payload in payloads:
                peer.send(payload)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(chan.run)
        assert got == [b"one", b"bye"], got
    finally:
        chan.close()
        peer.close(linger=0)
        ctx.term()


async def test_a_reconnect_makes_a_new_connection_and_its_answers_are_read() -> None:
    """What a receiver does to a sender found silent (its connection may be open with nothing coming through):
    the ROUTER sees a new peer, and what it answers there is read (the disconnect and connect ran ZeroMQ's
    commands, which may consume the descriptor's edge). An endpoint never connected to is refused as such."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    got: list[list[bytes]] = []
    chan = ControlSocket(dealer, got.append, name="test-dealer", bundles=True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(chan.run)
            chan.send([b"before"])
            [[old, _]] = await anyio.to_thread.run_sync(_wire_messages, router, 1)
            chan.reconnect(endpoint)
            chan.send([b"after"])
            [[new, payload]] = await anyio.to_thread.run_sync(_wire_messages, router, 1)
            assert payload == b"after" and new != old
            router.send_multipart([new, b"answer"])
            with anyio.fail_after(5):
                while not got:  # the handler only appends
                    await anyio.sleep(0.01)
            assert got == [[b"answer"]]
            with pytest.raises(zmq.ZMQError):
                chan.reconnect("tcp://127.0.0.1:1")
            tg.cancel_scope.cancel()
    finally:
        chan.close()
        router.close(linger=0)
        ctx.term()
