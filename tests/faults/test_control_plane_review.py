"""Control-plane regressions found by a review; each failed on the code before its fix.

1. Heartbeat settings of the two sides that each validate but disagree: the sender dropped a live receiver.
2. A REJECT from a receiver that is not a rank of a room ended that room for its real receiver.
3. A sender that went silent and then exited left its blocks fenced for good.
4. One refused handshake kept the connection refused for good, even after the sender was fixed.
5. One socket saying HELLO as a second receiver id left the first session alive and out of reach.
6. Settings past the wire's limits, or a heartbeat that flaps by design, are refused at construction.
7. One sender reached under two addresses: the receiver's two connections ended each other's sessions for good.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from aioembed import (
    ConfigError,
    EmbeddingReceiver,
    EmbeddingSender,
    IncompatiblePeer,
    PeerDead,
    TransferAborted,
    TransferConfig,
    TransferFailed,
    TransferStatus,
)
from aioembed.control.address_probe import ProbeVerdict
from aioembed.metrics import TransferObserver
from aioembed.protocol.messages import MAX_FRAME_BYTES, Abort, AbortAck, Hello, Init, Reject, Status, Welcome
from aioembed.session import connection
from aioembed.session.handle import ReceiveHandle
from aioembed.testing.ports import fixed_port
from aioembed.transports.loopback import LoopbackTransport

from ..session.conftest import LAYOUT, assert_same, make_request
from .rawpeer import RawReceiver, RawSender, raw_receiver, raw_sender

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, input_timeout=8.0)


async def _served(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: int, *, sender_at: str | None = None,
                  ) -> None:
    """One room sent and received, bit for bit."""
    src = make_request(300, room)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send, room, src)
        got = await receiver.receive(room, sender=sender_at)
    assert_same(got.tensors, src)


async def test_the_receiver_pings_at_the_senders_interval_when_it_is_shorter() -> None:
    sender_cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=5)  # silent after 0.5 s
    receiver_cfg = CFG.replace(heartbeat_interval=1.0, heartbeat_misses=5)  # pinged every 1 s before
    async with EmbeddingSender(LAYOUT, sender_cfg) as s, \
            EmbeddingReceiver(LAYOUT, receiver_cfg, connect=s.address) as r:
        await r.wait_connected()
        await anyio.sleep(2.0)
        assert r._conns[s.address].sessions == 1, "the sender dropped the live receiver"
        await _served(s, r, 1)


async def test_a_reject_from_a_receiver_that_is_not_a_rank_of_the_room_is_ignored() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as s, EmbeddingReceiver(LAYOUT, CFG, connect=s.address) as r, \
            raw_receiver(s.address, LAYOUT, CFG) as other:
        await r.wait_connected()
        other.send(other.hello(LAYOUT, CFG, receiver_id="someone-else"))
        await other.expect(Welcome)
        handle = r.start(7)
        with anyio.fail_after(5):
            while s.rooms_in_flight == 0:
                await anyio.sleep(0.01)
        other.send(Reject(reason="not mine", room=7))
        await anyio.sleep(0.2)
        src = make_request(300, 2)
        await s.send(7, src)
        with anyio.fail_after(5):
            got = await handle.result()
        assert_same(got.tensors, src)


async def test_a_reject_from_the_rank_of_a_room_without_send_tells_the_other_ranks_at_once() -> None:
    async with EmbeddingSender(LAYOUT, CFG) as s, \
            raw_receiver(s.address, LAYOUT, CFG) as rank0, raw_receiver(s.address, LAYOUT, CFG) as rank1:
        for rank, raw in enumerate((rank0, rank1)):
            raw.send(raw.hello(LAYOUT, CFG, receiver_id=f"rank{rank}", rank=rank, world=2))
            await raw.expect(Welcome)
            raw.send(Init(room=9, blocks=(0,), allocated_tokens=128, expected_ranks=2))
        with anyio.fail_after(5):
            while 9 not in s._rooms or len(s._rooms[9].rank_peer) < 2:  # both INITs taken
                await anyio.sleep(0.01)
        rank0.send(Reject(reason="cannot take it", room=9))
        status = await rank1.expect(Status, timeout=2.0)  # not at its input_timeout (8 s)
        assert isinstance(status, Status) and status.room == 9 and "rejected" in (status.error or "")
        with pytest.raises(Exception, match="rejected"):
            await s.send(9, make_request(100, 3))


class _NonRevocable(LoopbackTransport):
    capabilities = dataclasses.replace(LoopbackTransport.capabilities, revocable=False, orphan_lifetime=0.3)


async def _announce_a_room(r: EmbeddingReceiver, raw: RawSender) -> ReceiveHandle:
    """Room 1 of ``r``, announced to ``raw`` in a live session (it answers the handshake, as a sender would)."""
    handle = r.start(1, sender=raw.address)
    raw.welcome(await raw.expect(Hello), 0.1)
    await raw.expect(Init)
    return handle


async def test_a_sender_that_went_silent_and_then_exited_releases_its_blocks() -> None:
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=3, input_timeout=30.0)
    async with EmbeddingReceiver(LAYOUT, cfg, transport=_NonRevocable()) as r:
        async with raw_sender() as raw:
            handle = await _announce_a_room(r, raw)
            raw.pong = False  # frozen: the receiver declares it silent and fences the room's blocks
            with pytest.raises(PeerDead, match="silent"):
                await handle.result()
            assert r.allocator.stats.fenced > 0
        # the process ended: its connection closed; its writes can land for orphan_lifetime at most
        with anyio.fail_after(5):
            while r.allocator.stats.free != r.allocator.stats.total:
                await anyio.sleep(0.02)


class _Probes(TransferObserver):
    def __init__(self) -> None:
        self.verdicts: list[str] = []

    def disconnect_probed(self, *, sender: str, verdict: str) -> None:
        self.verdicts.append(verdict)


async def test_a_silent_sender_whose_connection_drops_keeps_its_blocks_fenced_until_its_address_refuses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A drop after the sender went silent is what the *receiver's* kernel does to a host that is paused or cut off
    (after about 15 minutes of retransmits): that host's writes land when it resumes (over Mooncake's TCP transport
    the data connection stays open). Such blocks were freed ``orphan_lifetime`` after the drop. Now only the address
    refusing a connection proves the process gone; while it gives no answer the blocks stay fenced, and it is asked
    again. (The probe is scripted here: a paused host cannot be made on one machine; the probe's verdicts on real
    sockets are tested in test_address_probe.)"""
    verdict = ProbeVerdict.NO_ANSWER
    asked: list[str] = []

    async def probe(address: str, timeout: float) -> ProbeVerdict:
        asked.append(address)
        return verdict

    monkeypatch.setattr(connection, "probe_address", probe)
    monkeypatch.setattr(connection, "PROBE_RETRY_FIRST", 0.1)
    monkeypatch.setattr(connection, "PROBE_RETRY_MAX", 0.2)
    probes = _Probes()
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=3, input_timeout=30.0)
    async with EmbeddingReceiver(LAYOUT, cfg, transport=_NonRevocable(), observer=probes) as r:
        async with raw_sender() as raw:
            handle = await _announce_a_room(r, raw)
            raw.pong = False
            with pytest.raises(PeerDead, match="silent"):
                await handle.result()
            fenced = r.allocator.stats.fenced
            assert fenced > 0
        with anyio.fail_after(5):
            while len(asked) < 3:  # the connection dropped: asked, and asked again
                await anyio.sleep(0.02)
        assert r.allocator.stats.fenced == fenced  # well past orphan_lifetime (0.3 s): still fenced
        assert set(probes.verdicts) == {"no_answer"}
        verdict = ProbeVerdict.REFUSED  # the host is back, and nothing listens there: the process is gone
        with anyio.fail_after(5):
            while r.allocator.stats.free != r.allocator.stats.total:
                await anyio.sleep(0.02)
        assert probes.verdicts[-1] == "refused"


def _kill_connections_to(port: int) -> None:
    """Destroy this host's TCP sockets whose peer port is ``port`` (``ss -K``: root, and a kernel built with
    INET_DIAG_DESTROY), as the receiver's kernel does to a connection it gave up on."""
    ss = shutil.which("ss")
    if ss is None or os.geteuid() != 0:
        pytest.skip("killing a TCP connection needs root and `ss`")
    subprocess.run([ss, "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], capture_output=True, timeout=10,
                   check=False)


async def test_a_connection_reset_in_a_live_session_is_no_proof_while_the_address_answers() -> None:
    """The control connection of a live session dropped, but the sender still listens (a middlebox reset it; here
    the receiver's kernel destroys it): its writes may still be landing. They were taken as a process gone, its
    blocks freed ``orphan_lifetime`` later; now they wait for its next handshake, or for proof it is gone."""
    probes = _Probes()
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=30, input_timeout=30.0)
    async with EmbeddingReceiver(LAYOUT, cfg, transport=_NonRevocable(), observer=probes) as r:
        async with raw_sender() as raw:
            handle = await _announce_a_room(r, raw)
            fenced_before = r.allocator.stats.fenced
            _kill_connections_to(int(raw.address.rsplit(":", 1)[1]))
            with pytest.raises(PeerDead, match="closed the control connection"):
                await handle.result()
            with anyio.fail_after(5):
                while not probes.verdicts:
                    await anyio.sleep(0.02)
            assert probes.verdicts == ["answered"]
            await anyio.sleep(1.0)  # past orphan_lifetime (0.3 s)
            assert r.allocator.stats.fenced > fenced_before
            # The receiver shook hands again; the raw sender does not answer. It ends: its address refuses.
        with anyio.fail_after(5):
            while r.allocator.stats.free != r.allocator.stats.total:
                await anyio.sleep(0.02)
        assert probes.verdicts[-1] == "refused"


async def test_a_probe_verdict_counts_only_for_the_drop_it_was_asked_after(monkeypatch: pytest.MonkeyPatch) -> None:
    """A live session's connection was reset; while the probe was out, the same sender shook hands again and that
    session was lost SILENT (its host paused or cut off). The probe's "no answer" was judged with the flag of the
    earlier, live, drop: the sender was taken as gone and its blocks freed (a review found it). Now a verdict
    asked before a session came and went is asked again, and a WELCOME clears the flag: the blocks stay fenced."""
    async def probe(address: str, timeout: float) -> ProbeVerdict:
        await anyio.sleep(timeout)  # a cut-off host: no answer until the timeout
        return ProbeVerdict.NO_ANSWER

    monkeypatch.setattr(connection, "probe_address", probe)
    monkeypatch.setattr(connection, "PROBE_TIMEOUT", 1.5)
    probes = _Probes()
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=3, input_timeout=30.0)
    async with EmbeddingReceiver(LAYOUT, cfg, transport=_NonRevocable(), observer=probes) as r:
        async with raw_sender() as raw:
            handle = await _announce_a_room(r, raw)
            _kill_connections_to(int(raw.address.rsplit(":", 1)[1]))  # reset in a live session: a probe goes out
            with pytest.raises(PeerDead, match="closed the control connection"):
                await handle.result()
            fenced = r.allocator.stats.fenced
            assert fenced > 0
            raw.welcome(await raw.expect(Hello), 0.1)  # the same sender, back (no DRAINED yet) ...
            conn = r._conns[raw.address]
            with anyio.fail_after(2):
                while not conn.ready:
                    await anyio.sleep(0.01)
            raw.pong = False  # ... and silent: lost with no drop
            with anyio.fail_after(2):
                while conn.ready:
                    await anyio.sleep(0.01)
            await anyio.sleep(2.5)  # past the probe (1.5 s) and orphan_lifetime (0.3 s)
            assert r.allocator.stats.fenced == fenced and conn._gone_sender is None, probes.verdicts


async def test_an_address_that_answered_is_asked_again_and_a_sender_gone_before_it_reconnected_is_seen() -> None:
    """A live session's connection was reset while the sender still listened (answered: its handshake would tell);
    then its process ended before ZeroMQ reconnected, so no drop ever followed, and no handshake. The probe had
    stopped at the answer: the blocks stayed fenced for good, where before the change they came back (a review
    found it). Now it asks again until something tells: the address refuses."""
    probes = _Probes()
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=30, input_timeout=30.0)
    async with EmbeddingReceiver(LAYOUT, cfg, transport=_NonRevocable(), observer=probes) as r:
        async with raw_sender() as raw:
            handle = await _announce_a_room(r, raw)
            _kill_connections_to(int(raw.address.rsplit(":", 1)[1]))
            with anyio.fail_after(5):
                while not probes.verdicts:
                    await anyio.sleep(0.001)
        # the raw sender is gone, before the receiver reconnected
        with pytest.raises(PeerDead):
            await handle.result()
        with anyio.fail_after(10):
            while r.allocator.stats.free != r.allocator.stats.total:
                await anyio.sleep(0.02)
        assert probes.verdicts[0] == "answered" and probes.verdicts[-1] == "refused", probes.verdicts


async def test_a_refused_handshake_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "REFUSAL_RETRY", 0.3)
    address = f"tcp://127.0.0.1:{fixed_port()}"
    good = CFG.replace(handshake_timeout=2.0, input_timeout=3.0)
    async with EmbeddingReceiver(LAYOUT, good, connect=address) as r:
        async with EmbeddingSender(LAYOUT, good.replace(block_size=256), bind=address):
            with pytest.raises(IncompatiblePeer, match="block_size"):
                await r.receive(1)
        async with EmbeddingSender(LAYOUT, good, bind=address) as s:  # fixed, at the same address
            conn = r._conns[address]
            with anyio.fail_after(10):
                while not conn.ready:  # refused until the next handshake, a REFUSAL_RETRY later
                    await anyio.sleep(0.05)
            await _served(s, r, 2)


async def test_a_session_loss_told_while_refused_does_not_leave_handshake_waiters_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a connection is refused (between sessions), something may still report the loss of its last session:
    ``declare_sender_gone()`` for the sender it served before, a late PONG of that session, a drop of the refusing
    sender's connection. ``session_lost`` took the refusal's set ready event for a live session and replaced it
    with an unset one: handshake waiters then slept on an event nothing would set (the retry makes another), each
    for its whole timeout, instead of seeing the refusal at once (or the next handshake)."""
    monkeypatch.setattr(connection, "REFUSAL_RETRY", 1.0)
    address = f"tcp://127.0.0.1:{fixed_port()}"
    good = CFG.replace(handshake_timeout=2.0, input_timeout=3.0)
    async with EmbeddingReceiver(LAYOUT, good, connect=address) as r:
        async with EmbeddingSender(LAYOUT, good, bind=address) as s:
            await _served(s, r, 1)  # a session, whose writer the connection keeps
        conn = r._conns[address]
        with anyio.fail_after(5):
            while conn.ready:  # the disconnect reaches the receiver through a monitor event, a moment later
                await anyio.sleep(0.02)
        async with EmbeddingSender(LAYOUT, good.replace(block_size=256), bind=address):
            with anyio.fail_after(5), pytest.raises(IncompatiblePeer, match="block_size"):
                await r.wait_connected(timeout=5.0)
            assert conn.refused is not None
            r.declare_sender_gone()  # the first sender is gone indeed (reported while refused)
            with anyio.fail_after(0.5), pytest.raises(IncompatiblePeer, match="block_size"):
                await r.wait_connected(timeout=5.0)  # the refusal, at once: no session was live to lose
        async with EmbeddingSender(LAYOUT, good, bind=address) as s:  # fixed, at the same address
            with anyio.fail_after(5):
                while not conn.ready:  # refused until the next handshake, a REFUSAL_RETRY later
                    await anyio.sleep(0.05)
            await _served(s, r, 2)


async def test_one_sender_under_two_addresses_is_refused_on_the_second_not_flipped_for_good() -> None:
    """A receiver reaching one sender as ``tcp://127.0.0.1:P`` and ``tcp://localhost:P``: its two connections
    shared its receiver id, the sender keeps one session per receiver, so each HELLO ended the other connection's
    session, which shook hands again at its next PING, and so on for good (a review counted 15 sessions in 2 s),
    failing the rooms in flight at each turn. The second connection now stands down with an error naming both."""
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=5, handshake_timeout=2.0)
    async with EmbeddingSender(LAYOUT, cfg) as s, EmbeddingReceiver(LAYOUT, cfg) as r:
        port = s.address.rsplit(":", 1)[1]
        a, b = f"tcp://127.0.0.1:{port}", f"tcp://localhost:{port}"
        await r.wait_connected(sender=a)
        with anyio.fail_after(5), pytest.raises(TransferFailed, match="under two addresses") as err:
            await r.wait_connected(sender=b)
        assert a in str(err.value) and b in str(err.value)
        with anyio.fail_after(5), pytest.raises(TransferFailed, match="under two addresses"):
            await r.receive("via-b", sender=b)  # at once, not after a handshake timeout
        await anyio.sleep(1.0)  # ten heartbeats: no more turns
        conn_a = r._conns[a]
        with anyio.fail_after(5):
            while not conn_a.ready:  # b's one HELLO ended a's session once: a shook hands again
                await anyio.sleep(0.02)
        sessions = conn_a.sessions
        await anyio.sleep(1.0)
        assert conn_a.sessions == sessions <= 2 and r._conns[b].sessions == 0
        for i in range(3):
            await _served(s, r, i, sender_at=a)


async def test_a_connection_that_stood_down_for_a_twin_serves_a_new_sender_once_the_twin_lost_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin rule holds only while the other connection has a live session with that sender: a connection keeps
    the id of a sender that has gone. A sender bound on every interface was reached as 127.0.0.1 and 127.0.0.2 (the
    second stood down); it exited, and a new sender came up on 127.0.0.2 only (a pod's address changed). The second
    connection stayed refused on the old sender's id, without a HELLO, until the first was closed for idleness
    (``sender_idle_timeout``, 300 s by default; a review watched it for 16 s)."""
    monkeypatch.setattr(connection, "REFUSAL_RETRY", 0.3)
    cfg = CFG.replace(heartbeat_interval=0.1, heartbeat_misses=5, handshake_timeout=1.0)
    async with EmbeddingReceiver(LAYOUT, cfg) as r:
        async with EmbeddingSender(LAYOUT, cfg, bind="tcp://0.0.0.0:0") as first:
            port = first.address.rsplit(":", 1)[1]
            a, b = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.2:{port}"
            await r.wait_connected(sender=a)
            with anyio.fail_after(5), pytest.raises(TransferFailed, match="under two addresses"):
                await r.wait_connected(sender=b)
        async with EmbeddingSender(LAYOUT, cfg, bind=f"tcp://127.0.0.2:{port}") as second:
            assert second.sender_id != first.sender_id
            conn_b = r._conns[b]
            with anyio.fail_after(10):
                while not conn_b.ready:  # refused for a while (a refusal's retry), then a session with it
                    await anyio.sleep(0.05)
            assert conn_b.sender_id == second.sender_id
            await _served(second, r, 1, sender_at=b)


async def test_a_second_receiver_id_on_one_socket_ends_the_first_session() -> None:
    cfg = CFG.replace(heartbeat_interval=0.2)
    async with EmbeddingSender(LAYOUT, cfg) as s, raw_receiver(s.address, LAYOUT, cfg) as raw:
        raw.send(raw.hello(LAYOUT, cfg, receiver_id="a"))
        await raw.expect(Welcome)
        raw.send(Init(room=5, blocks=(0,), allocated_tokens=128, expected_ranks=1))
        with anyio.fail_after(5):
            while s.rooms_in_flight == 0:
                await anyio.sleep(0.01)
        first = s._peers.of("a")
        assert first is not None
        raw.send(raw.hello(LAYOUT, cfg, receiver_id="b"))
        await raw.expect(Welcome)
        assert not first.alive and not first.rooms and not s._ledger.is_open(first.key)
        with anyio.fail_after(5):
            while s.rooms_in_flight:
                await anyio.sleep(0.01)


@pytest.mark.parametrize(("setting", "value", "match"), [
    ("max_metadata_bytes", MAX_FRAME_BYTES, "max_metadata_bytes"),
    ("heartbeat_misses", 1, "heartbeat_misses"),
    ("block_size", 1 << 21, "block_size"),
])
def test_settings_past_the_wire_limits_are_refused(setting: str, value: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TransferConfig(**{setting: value})


def test_a_pool_of_more_blocks_than_a_hello_can_announce_is_refused() -> None:
    with pytest.raises(ConfigError, match="blocks"):
        TransferConfig(block_size=1, default_tokens=1, pool_tokens=(1 << 32) + 1)


async def test_an_abort_crossing_a_ranks_final_status_is_acknowledged() -> None:
    """A rank told the room's end (its final STATUS) whose ABORT crossed it on the wire got no ABORT_ACK while
    other ranks were still written, so its receiver kept the room id unusable; and the ABORT ended the room
    for the other ranks too."""
    async with EmbeddingSender(LAYOUT, CFG) as s, \
            raw_receiver(s.address, LAYOUT, CFG) as rank0, raw_receiver(s.address, LAYOUT, CFG) as rank1:
        for rank, raw in enumerate((rank0, rank1)):
            raw.send(raw.hello(LAYOUT, CFG, receiver_id=f"rank{rank}", rank=rank, world=2))
            await raw.expect(Welcome)
        rank0.send(Init(room=4, blocks=(0, 1), allocated_tokens=256, expected_ranks=2))
        src = make_request(200, 5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(s.send, 4, src)
            done = await rank0.expect(Status)  # written and told: its part of the room is over
            assert isinstance(done, Status) and done.state == "SUCCESS"
            rank0.send(Abort(room=4, reason="cancelled as the rows came"))
            await rank0.expect(AbortAck, timeout=2.0)
            rank1.send(Init(room=4, blocks=(0, 1), allocated_tokens=256, expected_ranks=2))  # the room goes on
            done = await rank1.expect(Status)
            assert isinstance(done, Status) and done.state == "SUCCESS"


WORLD_2 = TransferConfig(default_tokens=1024, pool_tokens=4096, staging_tokens=0, heartbeat_interval=5.0,
                         input_timeout=3.0)


@asynccontextmanager
async def _two_raw_ranks() -> AsyncIterator[tuple[EmbeddingSender, RawReceiver, RawReceiver]]:
    """A sender and two hand-driven ranks (receivers "A" and "B") of one world of 2, both handshaken."""
    async with EmbeddingSender(LAYOUT, WORLD_2) as sender, \
            raw_receiver(sender.address, LAYOUT, WORLD_2) as a, raw_receiver(sender.address, LAYOUT, WORLD_2) as b:
        for raw, name, rank in ((a, "A", 0), (b, "B", 1)):
            raw.send(raw.hello(LAYOUT, WORLD_2, receiver_id=name, rank=rank, world=2))
            await raw.expect(Welcome)
        yield sender, a, b


async def test_a_multi_rank_room_ended_by_one_rank_stays_ended_for_the_others_and_for_send() -> None:
    """Before send(): rank 0 reserves room x and ABORTs it. Rank 1's INIT, just after, was taken as a new
    request and erased the tombstone: send() then waited input_timeout for a rank 0 that never asks again
    (and rank 1 with it). Rank 1 is told the room is over; send() learns it at once; rank 0, which ended
    it, may ask for the id again."""
    async with _two_raw_ranks() as (sender, a, b):
        a.send(Init(room="x", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=2))
        a.send(Abort(room="x", reason="receive() timed out"))
        await a.expect(AbortAck)
        b.send(Init(room="x", blocks=tuple(range(8, 16)), allocated_tokens=1024, expected_ranks=2))
        told = await b.expect(Status)
        assert isinstance(told, Status) and told.state is TransferStatus.ABORTED and not told.fence
        assert "receive() timed out" in (told.error or "")
        with anyio.fail_after(1), pytest.raises(TransferAborted, match="ended by the receiver before send"):
            await sender.send("x", make_request(1000, 1))


@pytest.mark.parametrize("rank_1_first", [True, False])
async def test_a_multi_rank_pair_retries_a_room_one_of_its_ranks_aborted(rank_1_first: bool) -> None:
    """Both ranks had asked; rank 0 aborted and rank 1 was told. Their retry of the id is a new attempt,
    whichever rank asks first (rank 1 first was refused as a late INIT, and send() then timed out)."""
    async with _two_raw_ranks() as (sender, a, b):
        inits = {a: Init(room="x", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=2),
                 b: Init(room="x", blocks=tuple(range(8, 16)), allocated_tokens=1024, expected_ranks=2)}
        for raw, init in inits.items():
            raw.send(init)
        with anyio.fail_after(5):
            while "x" not in sender._rooms or len(sender._rooms["x"].rank_peer) < 2:
                await anyio.sleep(0.01)
        a.send(Abort(room="x", reason="rank 0 timed out"))
        await a.expect(AbortAck)
        assert (await b.expect(Status)).state is TransferStatus.ABORTED
        for raw in ((b, a) if rank_1_first else (a, b)):
            raw.send(inits[raw])
            await anyio.sleep(0.05)
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "x", make_request(500, 1))
                for raw in (a, b):
                    done = await raw.expect(Status)
                    assert done.state is TransferStatus.SUCCESS, done.error
