"""The ownership invariant on real sessions: a hypothesis-driven scripted sender against a real receiver.

The sender here tells the truth (every proof it gives holds) but does everything a real one may:
writes that land late, writes that fail and land later still (STATUS(fence=True), then
FENCE_RELEASE), silence, dropping the receiver's session (then DRAINED once its writes ended),
restarting under a new id, aborting rooms. The receiver starts rooms, cancels some, holds leases
and releases them. The sender lands its bytes itself, through the receiver's MockTransport (so a
revoked link lands nothing), and at each landing checks that every target block is still owned by
the very grant it was announced for: **a block is never freed or re-announced while a write may
reach it**. And every room ends by its deadline; at the end the pool comes back whole.

Runs on asyncio and trio; ``make soak`` runs many more examples.
"""

from __future__ import annotations

import ctypes
import random
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioembed import EmbeddingReceiver, Field, Layout, TransferAborted, TransferConfig, TransferError, TransferStatus
from aioembed.control.channel import ControlSocket
from aioembed.memory.plan import FieldSpan, plan_row_runs, plan_writes
from aioembed.protocol.messages import (
    Abort,
    AbortAck,
    Drained,
    FenceRelease,
    Hello,
    Init,
    Message,
    Ping,
    Pong,
    Reject,
    Resume,
    Status,
    Welcome,
    decode,
    encode,
)
from aioembed.session.handle import ReceiveHandle
from aioembed.session.lease import Lease
from aioembed.testing import MockTransport
from aioembed.transports.loopback import LoopbackLink

LAYOUT = Layout(x=Field((8,), torch.float32), t=Field((), torch.int32))
CFG = TransferConfig(block_size=16, default_tokens=32, pool_tokens=160, resume_reserve_tokens=0,
                     heartbeat_interval=0.05, heartbeat_misses=3, handshake_timeout=0.5, input_timeout=2.0,
                     round_timeout=2.0, room_timeout=3.0)
ORPHAN_LIFETIME = 0.6  # the longest a late landing of ours takes after its post (0.4 s) fits in it


def rows(room: str, tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(room.encode()))
    return {"x": torch.randn(tokens, 8, generator=g), "t": torch.randint(0, 1 << 30, (tokens,), generator=g,
                                                                         dtype=torch.int32)}


@dataclass(eq=False)
class SentRoom:
    """The sender's view of one room in one receiver session."""

    room: str
    epoch: int
    total: int
    data: dict[str, torch.Tensor]
    round: int = 0
    sent: int = 0
    blocks: tuple[int, ...] = ()
    allocated: int = 0
    reserved: bool = False  # a reservation is in hand and unwritten
    writing: int = 0  # writes of it not yet landed
    aborted: bool = False
    ended: bool = False


@dataclass(eq=False)
class Landing:
    room: SentRoom
    epoch: int
    sender: str
    ops: list[tuple[int, int, int]]  # (dst, src, length)
    blocks: tuple[int, ...]
    link: LoopbackLink  # the link it was posted through (a revoked one lands nothing)


@dataclass
class Violations:
    found: list[str] = field(default_factory=list)


class ScriptedSender:
    """A ROUTER that speaks the protocol truthfully and writes as the script says."""

    def __init__(self, receiver_box: list[EmbeddingReceiver], violations: Violations, tg: anyio.abc.TaskGroup) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:0")
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.chan = ControlSocket(sock, self.on_frames, name="scripted-sender", routed=True, bundles=True)
        self.tg = tg
        self.receiver_box = receiver_box
        self.violations = violations
        self.transport = MockTransport()
        self.sender_id = uuid.uuid4().hex
        self.identity: bytes | None = None
        self.epoch = 0  # the receiver session this sender knows (0: none)
        self.link: LoopbackLink | None = None
        self.regions: tuple[tuple[int, int], ...] = ()
        self.rooms: dict[str, SentRoom] = {}
        self.silent = False
        self.inflight: list[Landing] = []
        self.owed_drain = False

    async def start(self) -> None:
        self.tg.start_soon(self.chan.run)

    async def close(self) -> None:
        self.chan.close()
        self.ctx.destroy(linger=0)
        await self.transport.aclose()

    def send(self, msg: Message) -> None:
        if self.identity is not None and not self.silent:
            self.chan.send([self.identity, encode(msg)])

    # -- protocol ----------------------------------------------------------------------------

    def on_frames(self, frames: list[bytes]) -> None:
        identity, payload = frames
        msg = decode(payload)
        if self.silent:
            return  # frozen: hears nothing, says nothing (its writes still land)
        if isinstance(msg, Hello):
            self.tg.start_soon(self.handshake, identity, msg)
        elif isinstance(msg, Ping):
            epoch = self.epoch if identity == self.identity else 0
            self.chan.send([identity, encode(Pong(nonce=msg.nonce, peer_id=self.sender_id, epoch=epoch))])
        elif identity != self.identity or self.epoch == 0:
            if isinstance(msg, (Init, Resume, Abort)):  # like the real sender: never an ack for it
                self.chan.send([identity, encode(Reject(reason="unknown peer", room=msg.room, code="unknown_peer"))])
        elif isinstance(msg, Init):
            r = SentRoom(str(msg.room), self.epoch, 0, {})
            r.blocks, r.allocated, r.reserved = msg.blocks, msg.allocated_tokens, True
            self.rooms[str(msg.room)] = r
        elif isinstance(msg, Resume):
            r = self.rooms.get(str(msg.room))
            if r is None or r.ended:
                self.send(Reject(reason="not started", room=msg.room))
            else:
                r.round, r.blocks, r.allocated, r.reserved = msg.round, msg.blocks, msg.allocated_tokens, True
        elif isinstance(msg, Abort):
            r = self.rooms.get(str(msg.room))
            if r is not None:
                r.aborted = r.ended = True
                r.reserved = False
            if r is None or r.writing == 0:
                self.send(AbortAck(room=msg.room))  # no write of it in flight: true

    async def handshake(self, identity: bytes, hello: Hello) -> None:
        self.link = await self.transport.connect(hello.descriptor)  # type: ignore[assignment]
        self.regions = hello.regions
        self.identity, self.epoch = identity, hello.epoch
        self.rooms = {}
        self.send(Welcome(sender_id=self.sender_id, epoch=hello.epoch, heartbeat_interval=CFG.heartbeat_interval,
                          writer_id=self.transport.writer_id))
        self.owed_drain = True
        self.maybe_drain()

    def maybe_drain(self) -> None:
        """DRAINED for earlier sessions, once none of our writes into them can land."""
        if self.owed_drain and self.epoch and not [w for w in self.inflight if w.epoch < self.epoch
                                                   and w.sender == self.sender_id]:
            self.owed_drain = False
            self.send(Drained(below_epoch=self.epoch))

    # -- writing -------------------------------------------------------------------------------

    def post(self, r: SentRoom) -> Landing | None:
        """Post the write of ``r``'s reservation (its bytes land when :meth:`land` is called)."""
        if self.link is None or not r.reserved or r.ended:
            return None
        if not r.total:
            r.total = random.Random(r.room).randint(8, 70)
            r.data = rows(r.room, r.total)
        count = min(r.allocated, r.total - r.sent)
        runs = plan_row_runs(num_tokens=count, block_size=CFG.block_size, dst_blocks=r.blocks, src_start=r.sent)
        spans = [FieldSpan(src_base=t.data_ptr(), dst_base=reg[0], row_bytes=f.row_bytes)
                 for t, reg, f in zip(r.data.values(), self.regions, LAYOUT.values(), strict=True)]
        ops = [(op.dst, op.src, op.length) for op in plan_writes(runs, spans)]
        r.reserved = False
        r.writing += 1
        landing = Landing(r, r.epoch, self.sender_id, ops, r.blocks, self.link)
        self.inflight.append(landing)
        return landing

    def land(self, w: Landing) -> None:
        """The bytes arrive now (like a NIC, whatever the control plane did meanwhile)."""
        self.inflight.remove(w)
        w.room.writing -= 1
        peer, writer = w.link._peer, w.link._local.id
        if peer._begin_landing(writer, w.link._generation):
            try:
                self.check(self.receiver_box[0], w)
                for dst, src, n in w.ops:
                    ctypes.memmove(dst, src, n)
            finally:
                peer._end_landing(writer, w.link._generation)
        r = w.room
        if r.aborted and r.writing == 0 and r.epoch == self.epoch and self.rooms.get(r.room) is r:
            self.send(AbortAck(room=r.room))  # its writes are over now: the abort can be acknowledged
        self.maybe_drain()

    def check(self, receiver: EmbeddingReceiver, w: Landing) -> None:
        ledger = receiver.keeper.ledger
        for b in w.blocks:
            g = ledger.owner_of(b)
            if g is None or g.room != w.room.room or g.writer is None or g.writer.epoch != w.epoch \
                    or g.writer.sender != w.sender:
                self.violations.found.append(
                    f"a write of room {w.room.room!r} (session {w.epoch}) landed in block {b}, now "
                    f"{'free' if g is None else f'owned by room {g.room!r} ({g.state.name}, {g.writer})'}")

    def status_after(self, r: SentRoom, count: int) -> None:
        if r.ended or r.epoch != self.epoch:
            return
        r.sent += count
        done = r.sent == r.total
        r.ended = done
        self.send(Status(room=r.room, state="SUCCESS" if done else "TRANSFERRING", total_tokens=r.total,
                         sent_tokens=r.sent, round=r.round))


# -- the script -----------------------------------------------------------------------------------

_ARGS = {
    "start": st.tuples(st.integers(0, 5), st.booleans()),
    "write": st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.05, 0.2, 0.4])),
    "poisoned": st.tuples(st.integers(0, 5), st.sampled_from([0.05, 0.2, 0.4])),
    "sender_abort": st.tuples(st.integers(0, 5), st.just(0)),
    "cancel": st.tuples(st.integers(0, 5), st.just(0)),
    "release": st.tuples(st.integers(0, 5), st.just(0)),
    "silence": st.tuples(st.sampled_from([0.05, 0.3]), st.just(0)),
    "drop_session": st.tuples(st.just(0), st.just(0)),
    "restart": st.tuples(st.just(0), st.just(0)),
    "wait": st.tuples(st.sampled_from([0.02, 0.1, 0.3]), st.just(0)),
}
# Rooms and writes are the raw material of every interesting interleaving: drawn more often.
_KINDS = ["start"] * 4 + ["write"] * 4 + ["poisoned"] * 2 + [
    k for k in _ARGS if k not in ("start", "write", "poisoned")]
ACTIONS = st.lists(st.sampled_from(_KINDS).flatmap(lambda k: _ARGS[k].map(lambda args: (k, *args))),
                   min_size=6, max_size=24)


async def run_script(script: list[tuple[Any, ...]], revocable: bool) -> list[str]:
    violations = Violations()
    handles: dict[str, ReceiveHandle] = {}
    leases: list[Lease] = []
    box: list[EmbeddingReceiver] = []
    senders: list[ScriptedSender] = []
    try:
        async with anyio.create_task_group() as tg:
            sender = ScriptedSender(box, violations, tg)
            senders.append(sender)
            await sender.start()
            transport = MockTransport(revocable=revocable, orphan_lifetime=ORPHAN_LIFETIME)
            async with EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=transport) as receiver:
                box.append(receiver)
                await receiver.wait_connected()

                async def land_later(w: Any, delay: float, then: Any = None) -> None:
                    await anyio.sleep(delay)
                    sender.land(w)
                    if then is not None:
                        then()

                def pick(i: int) -> Any:
                    live = [r for r in sender.rooms.values() if r.reserved and not r.ended]
                    return live[i % len(live)] if live else None

                for n, (kind, a, b) in enumerate(script):
                    if kind == "start" and receiver.rooms_in_flight < 5:
                        room = f"r{n}"
                        handles[room] = receiver.start(room, zero_copy=b)
                    elif kind == "write" and (r := pick(a)) is not None:
                        w = sender.post(r)
                        if w is not None:
                            count = min(r.allocated, r.total - r.sent)
                            tg.start_soon(land_later, w, b, lambda r=r, c=count: sender.status_after(r, c))
                    elif kind == "poisoned" and (r := pick(a)) is not None:
                        w = sender.post(r)
                        if w is not None:
                            r.ended = True  # the sender's room failed; its write lands later all the same
                            sender.send(Status(room=r.room, state="FAILED", total_tokens=r.total, sent_tokens=0,
                                               round=0, error="write timed out", fence=True))

                            def release(r: SentRoom = r) -> None:
                                if r.epoch == sender.epoch and not sender.silent:
                                    sender.send(FenceRelease(room=r.room))
                            tg.start_soon(land_later, w, b, release)
                    elif kind == "sender_abort" and (r := pick(a)) is not None and r.writing == 0:
                        r.ended = True
                        sender.send(Abort(room=r.room, reason="the encoder gave up"))
                    elif kind == "cancel" and handles:
                        list(handles.values())[a % len(handles)].cancel("the scheduler preempted it")
                    elif kind == "release":
                        for h in list(handles.values()):
                            # (not one that a cancel() after its end gave back: lease() raises for it)
                            if (h.done and isinstance(h._result, Lease) and not h._lease_taken
                                    and not h._result.released):
                                leases.append(await h.lease())
                        if leases:
                            leases.pop(a % len(leases)).release()
                    elif kind == "silence":
                        sender.silent = True
                        await anyio.sleep(a)
                        sender.silent = False
                    elif kind == "drop_session":
                        sender.identity, sender.epoch, sender.rooms = None, 0, {}
                    elif kind == "restart":
                        sender.sender_id = uuid.uuid4().hex
                        sender.identity, sender.epoch, sender.rooms = None, 0, {}
                    elif kind == "wait":
                        await anyio.sleep(a)
                    await anyio.sleep(0.01)

                # Every room ends by its deadline.
                with anyio.fail_after(CFG.room_timeout + 2.0):
                    for h in handles.values():
                        await h.wait()
                for h in handles.values():
                    if isinstance(h._result, Lease) and not h._lease_taken and not h._result.released:
                        leases.append(await h.lease())
                    elif isinstance(h._result, Lease) and not h._lease_taken:  # a cancel() after its end gave it back
                        with pytest.raises(TransferAborted, match="its lease was given back"):
                            await h.lease()
                    elif h.status is not TransferStatus.SUCCESS:
                        with pytest.raises(TransferError):
                            await h.wait()
                            await (h.lease() if h._error is None else h.result())
                for lease in leases:
                    lease.release()
                # The sender ends truthfully: its writes land; it drops the session, and once the receiver
                # shook hands again, confirms that every earlier session is drained.
                with anyio.fail_after(3):
                    while sender.inflight:
                        await anyio.sleep(0.01)
                sender.silent = False
                sender.identity, sender.epoch, sender.rooms = None, 0, {}
                with anyio.fail_after(3 + ORPHAN_LIFETIME):
                    while receiver.allocator.stats.used:
                        await anyio.sleep(0.01)
                assert len(receiver.keeper.ledger) == 0
            tg.cancel_scope.cancel()  # the sender's socket task ends before its socket closes
    finally:  # also when the script failed: a context left to the garbage collector hung a later example
        for sender in senders:
            await sender.close()
    return violations.found


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=ACTIONS, revocable=st.booleans())
def test_no_write_ever_lands_in_a_block_it_does_not_own(backend: str, script: list[tuple[Any, ...]],
                                                         revocable: bool) -> None:
    found = anyio.run(run_script, script, revocable, backend=backend)
    assert not found, found


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(script=ACTIONS, revocable=st.booleans())
def test_no_write_ever_lands_in_a_block_it_does_not_own_soak(backend: str, script: list[tuple[Any, ...]],
                                                              revocable: bool) -> None:
    """The same, with many more interleavings (``make soak``)."""
    found = anyio.run(run_script, script, revocable, backend=backend)
    assert not found, found

