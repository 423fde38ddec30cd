"""Every control frame from the network is validated before use: bad ones get a clear REJECT or
FAILED, a log line, and never a crash, a hang, a write outside the pool, or harm to other rooms."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import msgpack
import pytest
import torch

from aioembed import (
    EmbeddingReceiver,
    EmbeddingSender,
    TransferAborted,
    TransferConfig,
    TransferFailed,
    TransferTimeout,
)
from aioembed.errors import IncompatiblePeer
from aioembed.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    AbortAck,
    FenceRelease,
    Hello,
    Init,
    Ping,
    Pong,
    Reject,
    Resume,
    Status,
    Total,
    Welcome,
    encode,
)
from aioembed.testing import MockTransport, WriteFault

from ..session.conftest import LAYOUT, assert_same, make_request, room_goes_through, running, wait_pools_free
from .rawpeer import pool_guard, raw_receiver, raw_sender, welcomed_receiver

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=4096, max_rooms_per_peer=8, input_timeout=1.0,
                     handshake_timeout=2.0)


async def test_garbage_and_unknown_frames_are_rejected_and_valid_rooms_go_on() -> None:
    async with running(CFG) as (sender, [receiver]):
        async with raw_receiver(sender.address, LAYOUT, CFG) as raw:
            for junk in [b"", b"\xc1", b"\x92\x01\x02", msgpack.packb({"type": "NOPE", "v": PROTOCOL_VERSION}),
                         msgpack.packb({"type": "INIT", "v": 99, "room": 5}), b"\xff" * 1000]:
                raw.send_raw(junk)
                rej = await raw.expect(Reject)
                assert isinstance(rej, Reject) and rej.code == "bad_frame"
            ver = msgpack.packb({"type": "INIT", "v": 99, "room": 5})
            raw.send_raw(ver)
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and "version 99" in rej.reason and rej.room == 5
            # before HELLO, a well-formed INIT is refused: say HELLO first
            raw.send(Init(room=1, blocks=(0,), allocated_tokens=128, expected_ranks=1))
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and rej.code == "unknown_peer"
            await room_goes_through(sender, receiver, "ok", 2000, seed=1)  # meanwhile a real room works
        await wait_pools_free(sender, receiver)


async def test_a_flood_of_bad_frames_is_answered_each_time_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Every junk frame gets its REJECT; the log gets one WARNING (the rest at DEBUG): 200,000 junk frames wrote
    200,000 lines."""
    async with running(CFG) as (sender, [receiver]):
        async with raw_receiver(sender.address, LAYOUT, CFG) as raw:
            with caplog.at_level("DEBUG", logger="aioembed.session.sender"):
                for _ in range(50):
                    raw.send_raw(b"\xc1")
                for _ in range(50):
                    rej = await raw.expect(Reject)
                    assert isinstance(rej, Reject) and rej.code == "bad_frame"
        bad = [r for r in caplog.records if "bad frame from" in r.getMessage()]
        assert len(bad) == 50 and [r.levelname for r in bad] == ["WARNING"] + ["DEBUG"] * 49
        await wait_pools_free(sender, receiver)


async def test_a_flood_of_rejects_from_a_receiver_is_logged_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    """A REJECT is a frame a peer may send as fast as it likes, like a bad one: each logged a WARNING (two for one
    naming a room of which the peer is no rank), unbudgeted, where a bad frame's flood logs one per window."""
    async with running(CFG) as (sender, [receiver]):
        handle = receiver.start(7)
        with anyio.fail_after(5):
            while 7 not in sender._rooms:  # its INIT arrived: the raw peer below is no rank of it
                await anyio.sleep(0.01)
        async with welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
            with caplog.at_level("DEBUG", logger="aioembed.session.sender"):
                for _ in range(30):
                    raw.send(Reject(reason="no room named"))
                    raw.send(Reject(reason="not mine", room=7))
                raw.send(Ping(nonce=5))  # answered once the REJECTs before it were handled
                assert isinstance(await raw.expect(Pong), Pong)
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "reject" in r.getMessage().lower()]
        assert len(warned) <= 2, [r.getMessage() for r in warned]
        assert len([r for r in caplog.records if "not mine" in r.getMessage()]) == 30  # none lost: DEBUG
        src = make_request(300, 4)  # the room of the real receiver goes on
        await sender.send(7, src)
        assert_same((await handle.result()).tensors, src)
        await wait_pools_free(sender, receiver)


@pytest.mark.parametrize(("change", "code", "logged"), [
    ({"fingerprint": "v1-deadbeef"}, "incompatible", "refused rank"),  # a layout of another model
    ({"descriptor": b"no such endpoint"}, "refused", "cannot connect transport"),  # a transport it cannot reach
], ids=["incompatible", "unreachable"])
async def test_a_flood_of_refused_hellos_is_logged_once(caplog: pytest.LogCaptureFixture, change: dict[str, Any],
                                                       code: str, logged: str) -> None:
    """A peer without a session may say HELLO as often as it likes: each refused one logged a WARNING. Each is
    still answered (a REJECT with ``code``)."""
    async with running(CFG) as (sender, [receiver]):
        async with raw_receiver(sender.address, LAYOUT, CFG) as raw:
            hello = dataclasses.replace(raw.hello(LAYOUT, CFG), **change)
            with caplog.at_level("DEBUG", logger="aioembed.session.sender"):
                for epoch in range(1, 31):
                    raw.send(dataclasses.replace(hello, epoch=epoch))
                for _ in range(30):
                    rej = await raw.expect(Reject)
                    assert isinstance(rej, Reject) and rej.code == code, rej
        said = [r for r in caplog.records if logged in r.getMessage()]
        assert [r.levelname for r in said] == ["WARNING"] + ["DEBUG"] * 29, [r.levelname for r in said]
        await room_goes_through(sender, receiver, "ok", 300, seed=5)


async def test_a_flood_of_rejects_from_a_sender_is_logged_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    """The receiver's side: a REJECT naming no room, or an ``unknown_peer`` one naming no room of ours, logged a
    WARNING each, unbudgeted."""
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        raw.welcome(await raw.expect(Hello), 0.5)
        await receiver.wait_connected()
        with caplog.at_level("DEBUG", logger="aioembed.session.connection"):
            for i in range(30):
                raw.send(Reject(reason="no room named"))
                raw.send(Reject(reason="who?", room=1000 + i, code="unknown_peer"))
            raw.hold_pings = True
            raw.send(Ping(nonce=5))  # answered once the REJECTs before it were handled
            while not isinstance(pong := await raw.next(), Pong):
                pass
            assert pong.nonce == 5
        warned = [r for r in caplog.records if r.levelname == "WARNING" and "reject" in r.getMessage().lower()]
        assert len(warned) <= 2, [r.getMessage() for r in warned]
        assert len([r for r in caplog.records if "reject" in r.getMessage().lower()]) == 60  # none lost: DEBUG
        assert receiver._conns[raw.address].sessions == 1  # neither ended the session


async def test_a_large_frame_from_a_peer_without_a_session_is_refused_unread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Only HELLO or PING may come before a session: a larger valid frame (an INIT of a million block ids, 5 MB)
    is refused before it is decoded (each took about 0.1 s of the sender's loop), and the sender goes on."""
    import aioembed.session.sender as sender_module
    from aioembed.protocol.messages import MAX_HELLO_BYTES

    decoded: list[int] = []
    real_decode = sender_module.decode

    def counting(payload: bytes) -> object:
        decoded.append(len(payload))
        return real_decode(payload)

    monkeypatch.setattr(sender_module, "decode", counting)
    big = encode(Init(room=1, blocks=tuple(range(1 << 20)), allocated_tokens=128, expected_ranks=1))
    assert len(big) > MAX_HELLO_BYTES
    async with running(CFG) as (sender, [receiver]):
        async with raw_receiver(sender.address, LAYOUT, CFG) as raw:
            for _ in range(3):
                raw.send_raw(big)
                rej = await raw.expect(Reject)
                assert isinstance(rej, Reject) and rej.code == "unknown_peer", rej
                assert f"a frame of {len(big)} bytes" in rej.reason and "refused unread" in rej.reason
            assert len(big) not in decoded
            await room_goes_through(sender, receiver, "ok", 2000, seed=2)
        await wait_pools_free(sender, receiver)


async def test_a_peer_of_the_previous_protocol_version_is_refused_by_name() -> None:
    """Version 3 bundles messages that version 2 would drop: the two must not talk, and say why."""
    old = PROTOCOL_VERSION - 1
    async with raw_sender() as raw, EmbeddingReceiver(LAYOUT, CFG, connect=raw.address) as receiver:
        assert isinstance(await raw.expect(Hello), Hello)
        raw.send_raw(msgpack.packb({"type": "REJECT", "v": old, "reason": "bad frame", "code": "bad_frame"}))
        with pytest.raises(IncompatiblePeer, match=f"speaks protocol version {old}"):
            await receiver.wait_connected(timeout=5)
    async with running(CFG) as (sender, _), raw_receiver(sender.address, LAYOUT, CFG) as raw_r:
        body = msgpack.unpackb(encode(raw_r.hello(LAYOUT, CFG)))
        raw_r.send_raw(msgpack.packb({**body, "v": old}))
        rej = await raw_r.expect(Reject)
        assert isinstance(rej, Reject) and f"protocol version {old} is not supported" in rej.reason


async def test_incompatible_hello_is_rejected_with_what_differs() -> None:
    async with running(CFG) as (sender, _), raw_receiver(sender.address, LAYOUT, CFG) as raw:
        hello = dataclasses.replace(raw.hello(LAYOUT, CFG), fingerprint="v1-deadbeef", block_size=64)
        raw.send(hello)
        rej = await raw.expect(Reject)
        assert isinstance(rej, Reject) and rej.code == "incompatible"
        assert "fingerprint" in rej.reason and "block_size 64" in rej.reason


@pytest.mark.parametrize(("rank", "world"), [(1, 1), (5, 2)])
async def test_a_hello_whose_rank_is_outside_its_world_is_refused_at_the_handshake(rank: int, world: int) -> None:
    """It was welcomed, and every INIT of it then refused one by one ("outside world")."""
    async with running(CFG) as (sender, _), raw_receiver(sender.address, LAYOUT, CFG) as raw:
        raw.send(dataclasses.replace(raw.hello(LAYOUT, CFG), rank=rank, world=world))
        rej = await raw.expect(Reject)
        assert isinstance(rej, Reject) and rej.code == "incompatible"
        assert f"rank {rank} outside world {world}" in rej.reason


@pytest.mark.parametrize(
    ("init", "needle"),
    [
        (Init(room="r", blocks=(31, 32), allocated_tokens=256, expected_ranks=1), "outside"),
        (Init(room="r", blocks=(0,), allocated_tokens=129, expected_ranks=1), "do not fit"),
        (Init(room="r", blocks=(0, 1), allocated_tokens=100, expected_ranks=1), "do not fit"),
        (Init(room="r", blocks=(0,), allocated_tokens=128, expected_ranks=2), "world"),
        (Init(room="r", blocks=(0,), allocated_tokens=0, expected_ranks=1), "do not fit"),
    ],
)
async def test_bad_reservations_are_refused_and_leave_nothing(init: Init, needle: str) -> None:
    async with running(CFG) as (sender, _):
        async with welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
            before = pool_guard(raw.pool)
            raw.send(init)
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and rej.room == "r" and needle in rej.reason, rej
            assert rej.reason.startswith("INIT refused: "), rej.reason
            assert sender.rooms_in_flight == 0  # a refused INIT creates no room
            for name, t in raw.pool.tensors.items():
                assert torch.equal(t, before[name])


async def test_protocol_violations_after_a_valid_init() -> None:
    async with running(CFG) as (sender, _):
        async with welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
            raw.send(Resume(room="nope", round=1, sent_tokens=0, blocks=(0,), allocated_tokens=128))
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and "has not started" in rej.reason
            assert rej.reason.startswith("RESUME refused: "), rej.reason
            raw.send(Init(room="dup", blocks=(0, 1), allocated_tokens=256, expected_ranks=1))
            raw.send(Init(room="dup", blocks=(2, 3), allocated_tokens=256, expected_ranks=1))
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and "duplicate INIT" in rej.reason and rej.room == "dup"
            # The REJECT ended the room at the receiver (it freed the blocks): it is over here too.
            assert sender.rooms_in_flight == 0
            # a RESUME before any STATUS for the room is refused
            raw.send(Init(room="early", blocks=(0, 1), allocated_tokens=256, expected_ranks=1))
            raw.send(Resume(room="early", round=1, sent_tokens=0, blocks=(4,), allocated_tokens=128))
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and "not expected" in rej.reason and rej.room == "early"
            assert rej.reason.startswith("RESUME refused: "), rej.reason  # which of its frames broke the rule
            assert sender.rooms_in_flight == 0
            raw.send(Abort(room="early", reason="test over"))
            assert isinstance(await raw.expect(AbortAck), AbortAck)
        assert sender.rooms_in_flight == 0


async def test_a_refused_frame_ends_its_room_before_send_writes_into_its_blocks() -> None:
    """A REJECT naming a room ends the room at its receiver (which fences the blocks, or, if it is a hand-driven
    peer like this one, might free them): a ``send()`` of the room called afterwards must not write into them."""
    async with running(CFG) as (sender, _):
        async with welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
            before = pool_guard(raw.pool)
            raw.send(Init(room="q", blocks=(0, 1), allocated_tokens=256, expected_ranks=1))
            raw.send(Resume(room="q", round=3, sent_tokens=0, blocks=(4,), allocated_tokens=128))
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and rej.room == "q"
            assert sender.rooms_in_flight == 0
            with pytest.raises(TransferAborted, match="RESUME from rank 0 was not expected"):
                await sender.send("q", make_request(200, 1))
            for name, t in raw.pool.tensors.items():
                assert torch.equal(t, before[name]), name


async def test_a_frame_refused_while_a_write_is_in_flight_fences_it_and_ends_the_room() -> None:
    """The refusal is then a fence (the write may still land), the room fails at the sender (no STATUS of
    the round follows), and FENCE_RELEASE comes once the write ended."""
    writer = MockTransport(faults=lambda call: WriteFault(delay=0.5))
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender:
        async with raw_receiver(sender.address, LAYOUT, CFG, MockTransport()) as raw:
            raw.send(raw.hello(LAYOUT, CFG))
            assert isinstance(await raw.expect(Welcome), Welcome)
            raw.send(Init(room="w", blocks=tuple(range(8)), allocated_tokens=1024, expected_ranks=1))
            failures: list[BaseException] = []

            async def send() -> None:
                with pytest.raises(TransferFailed, match="was refused") as info:
                    await sender.send("w", make_request(3000, 1))
                failures.append(info.value)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                total = await raw.expect(Total)  # round 0's write has started
                assert isinstance(total, Total) and total.total_tokens == 3000
                assert sender.writes_in_flight == 1
                raw.send(Resume(room="w", round=5, sent_tokens=0, blocks=(9,), allocated_tokens=128))
                fence = await raw.next()
                assert isinstance(fence, Status) and fence.fence and fence.state == "FAILED", fence
                assert fence.room == "w" and "for round 5" in fence.error and "stay fenced" in fence.error, fence
                release = await raw.next()  # nothing of the room but the release: no STATUS of round 0
                assert isinstance(release, FenceRelease) and release.room == "w", release
            assert failures and sender.rooms_in_flight == 0 and sender.writes_in_flight == 0


async def test_rooms_per_peer_limit() -> None:
    async with running(CFG) as (sender, _):
        async with welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
            for i in range(CFG.max_rooms_per_peer):
                raw.send(Init(room=i, blocks=(i,), allocated_tokens=128, expected_ranks=1))
            raw.send(Init(room=99, blocks=(20,), allocated_tokens=128, expected_ranks=1))
            rej = await raw.expect(Reject)
            assert isinstance(rej, Reject) and rej.room == 99 and "max_rooms_per_peer" in rej.reason
            assert sender.rooms_in_flight == CFG.max_rooms_per_peer
            for i in range(CFG.max_rooms_per_peer):
                raw.send(Abort(room=i, reason="done"))
            for _ in range(CFG.max_rooms_per_peer):
                await raw.expect(AbortAck)
            assert sender.rooms_in_flight == 0


async def test_sender_writes_only_into_the_reserved_blocks() -> None:
    async with running(CFG) as (sender, _):
        async with welcomed_receiver(sender.address, LAYOUT, CFG) as raw:
            before = pool_guard(raw.pool)
            src = make_request(300, 3)
            blocks = (7, 2, 30)  # non-contiguous, out of order
            raw.send(Init(room="w", blocks=blocks, allocated_tokens=300, expected_ranks=1))
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "w", src, {"m": 1})
                status = await raw.expect(Status)
            assert isinstance(status, Status) and status.state == "SUCCESS" and status.sent_tokens == 300
            out = LAYOUT.empty(300)
            raw.pool.copy_out(list(blocks), 300, out, out_start=0)
            assert_same(out, src)
            touched = set()
            for b in blocks:
                touched.update(range(b * 128, (b + 1) * 128))
            for name, t in raw.pool.tensors.items():
                rows = [i for i in range(t.shape[0]) if i not in touched]
                assert torch.equal(t[rows], before[name][rows]), name


async def test_a_resume_that_never_comes_times_out_naming_the_rank_and_its_receiver() -> None:
    """A receiver that took round 0 and never asks for round 1: ``send()`` times out in phase ``resume``, and says
    which rank (and which receiver session) it waited for, not "a rank"."""
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, round_timeout=0.3, handshake_timeout=2.0)
    # (it sends no PING: the default heartbeats declare it dead after 5 s, the RESUME wait ends after 1.3 s)
    async with EmbeddingSender(LAYOUT, cfg) as sender, welcomed_receiver(sender.address, LAYOUT, cfg) as raw:
        raw.send(Init(room="r", blocks=(0, 1), allocated_tokens=256, expected_ranks=1))
        with anyio.fail_after(10), pytest.raises(TransferTimeout, match=r"phase 'resume' waiting for a RESUME from "
                                                                        r"rank 0 \(receiver rank 0 \("):
            await sender.send("r", make_request(600, 2))
