"""Fuzz both sides' sockets with hypothesis-generated and mutated frames while valid rooms run.

The sender gets junk from a second (raw) client, before and after that client's handshake. The
receiver gets junk injected by a proxy sitting between it and the real sender. Neither side may
crash or hang, no block may leak, and the valid rooms (whose ids the fuzzer never uses) must
still arrive bit for bit.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioembed import EmbeddingReceiver, TransferConfig
from aioembed.control.channel import ControlSocket
from aioembed.protocol import messages as m

from ..session.conftest import LAYOUT, assert_same, make_request, running, wait_pools_free
from .rawpeer import raw_receiver

CFG = TransferConfig(default_tokens=512, pool_tokens=4096, input_timeout=3.0, round_timeout=3.0,
                     handshake_timeout=2.0, max_rooms_per_peer=64)

# Fuzzed rooms never collide with the valid ones ("valid-N").
rooms = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1),
                  st.text(min_size=1, max_size=20).map(lambda s: "z" + s))
blocks = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40, unique=True).map(tuple)
tokens = st.integers(min_value=0, max_value=2**40)
small = st.integers(min_value=0, max_value=2**31)
text = st.text(max_size=50)
metadata = st.one_of(st.none(), st.dictionaries(
    st.text(max_size=5), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5), max_size=4))

messages = st.one_of(
    st.builds(m.Init, room=rooms, blocks=blocks, allocated_tokens=tokens, expected_ranks=st.integers(1, 4)),
    st.builds(m.Resume, room=rooms, round=small, sent_tokens=tokens, blocks=blocks, allocated_tokens=tokens),
    st.builds(m.Status, room=rooms, state=st.sampled_from(list(m.TransferStatus)), total_tokens=tokens,
              sent_tokens=tokens, round=small, metadata=metadata, error=st.none() | text, fence=st.booleans()),
    st.builds(m.Abort, room=rooms, reason=text),
    st.builds(m.AbortAck, room=rooms),
    st.builds(m.Ping, nonce=st.integers(0, 2**62)),
    st.builds(m.Pong, nonce=st.integers(0, 2**62), peer_id=st.text(max_size=10)),
    st.builds(m.Reject, reason=text, room=st.none() | rooms, code=st.sampled_from(m.REJECT_CODES)),
    st.builds(m.Welcome, sender_id=st.text(max_size=10), epoch=st.integers(1, 5),
              heartbeat_interval=st.floats(0.01, 100)),
    st.builds(m.FenceRelease, room=rooms),
    st.builds(m.Drained, below_epoch=st.integers(1, 5)),
)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "valid", "mutated"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    data = m.encode(draw(messages))
    if kind == "valid":
        return data
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        i = draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[i] ^= draw(st.integers(1, 255))
        elif op == "insert":
            buf.insert(i, draw(st.integers(0, 255)))
        elif buf:
            del buf[i]
    return bytes(buf)


async def _valid_rooms(sender: object, receiver: EmbeddingReceiver, count: int, seed: int) -> None:
    rng = random.Random(seed)
    srcs = {f"valid-{i}": make_request(rng.choice([1, 300, 700, 1500]), seed=seed * 100 + i) for i in range(count)}
    got = {}

    async def one(room: str) -> None:
        got[room] = await receiver.receive(room)

    async with anyio.create_task_group() as tg:
        for room, src in srcs.items():
            tg.start_soon(one, room)
            tg.start_soon(sender.send, room, src)  # type: ignore[attr-defined]
    for room, src in srcs.items():
        assert_same(got[room].tensors, src)


async def _fuzz_sender(junk: list[bytes]) -> None:
    async with running(CFG) as (sender, [receiver]):
        async with raw_receiver(sender.address, LAYOUT, CFG) as raw, anyio.create_task_group() as tg:

            async def pound() -> None:
                half = len(junk) // 2
                for data in junk[:half]:  # before the handshake
                    raw.send_raw(data)
                    await anyio.lowlevel.checkpoint()
                raw.send(raw.hello(LAYOUT, CFG, receiver_id="fuzzer"))
                for data in junk[half:]:  # after it: frames reach the room logic
                    raw.send_raw(data)
                    await anyio.lowlevel.checkpoint()
                # end whatever the fuzzer opened, as a well-behaved client would
                for data in junk:
                    try:
                        msg = m.decode(data)
                    except m.ProtocolError:
                        continue
                    if isinstance(msg, m.Init):
                        raw.send(m.Abort(room=msg.room, reason="fuzz over"))

            tg.start_soon(pound)
            await _valid_rooms(sender, receiver, 6, seed=len(junk))
        with anyio.fail_after(CFG.input_timeout + 5):
            while sender.rooms_in_flight:
                await anyio.sleep(0.05)
        await wait_pools_free(sender, receiver)


@asynccontextmanager
async def _injecting_proxy(upstream: str) -> AsyncIterator[tuple[str, ControlSocket, list[bytes]]]:
    """A ROUTER<->DEALER forwarder; yields its address, its ROUTER channel and the receiver identity."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    front = ctx.socket(zmq.ROUTER)
    front.setsockopt(zmq.LINGER, 0)
    front.bind("tcp://127.0.0.1:0")
    back = ctx.socket(zmq.DEALER)
    back.setsockopt(zmq.LINGER, 0)
    back.connect(upstream)
    identity: list[bytes] = []
    front_chan: ControlSocket
    back_chan: ControlSocket

    def from_receiver(fr: list[bytes]) -> None:
        if not identity:
            identity.append(fr[0])
        back_chan.send([fr[1]])

    def from_sender(fr: list[bytes]) -> None:
        if identity:
            front_chan.send([identity[0], fr[0]])

    front_chan = ControlSocket(front, from_receiver, name="proxy-front", routed=True, bundles=True)
    back_chan = ControlSocket(back, from_sender, name="proxy-back", bundles=True)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(front_chan.run)
            tg.start_soon(back_chan.run)
            yield front.getsockopt_string(zmq.LAST_ENDPOINT), front_chan, identity
            tg.cancel_scope.cancel()
    finally:
        front_chan.close()
        back_chan.close()
        ctx.term()


async def _fuzz_receiver(junk: list[bytes]) -> None:
    async with running(CFG, world=1) as (sender, _):
        async with _injecting_proxy(sender.address) as (address, front, identity):
            async with EmbeddingReceiver(LAYOUT, CFG, connect=address) as receiver:
                await receiver.wait_connected()
                async with anyio.create_task_group() as tg:

                    async def pound() -> None:
                        for data in junk:
                            front.send([identity[0], data])
                            await anyio.lowlevel.checkpoint()

                    tg.start_soon(pound)
                    await _valid_rooms(sender, receiver, 6, seed=len(junk) + 1)
                st_ = receiver.allocator.stats
                assert st_.free == st_.total and st_.fenced == 0, st_
                assert receiver.rooms_in_flight == 0


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=st.lists(frames(), min_size=20, max_size=120))
def test_fuzzed_frames_to_the_sender(junk: list[bytes]) -> None:
    anyio.run(_fuzz_sender, junk)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=st.lists(frames(), min_size=20, max_size=120))
def test_fuzzed_frames_to_the_receiver(junk: list[bytes]) -> None:
    anyio.run(_fuzz_receiver, junk)


@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=st.lists(frames(), min_size=20, max_size=80))
def test_fuzzed_frames_under_trio(junk: list[bytes]) -> None:
    anyio.run(_fuzz_sender, junk, backend="trio")
    anyio.run(_fuzz_receiver, junk, backend="trio")
