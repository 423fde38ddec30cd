"""Failure paths: cancellation on either side, timeouts per phase, incompatible peers, bad input.

After each, both sides must have released everything (no block, registration or room left).
"""

from __future__ import annotations

import traceback
from contextlib import suppress
from typing import Any

import anyio
import anyio.abc
import pytest
import torch

from aioembed import (
    EmbeddingReceiver,
    EmbeddingSender,
    Field,
    IncompatiblePeer,
    InvalidRequest,
    Layout,
    LayoutError,
    Part,
    TransferAborted,
    TransferConfig,
    TransferError,
    TransferFailed,
    TransferStatus,
    TransferTimeout,
)
from aioembed.protocol.messages import FenceRelease, Status
from aioembed.session.receive_room import ReceiveRoomDriver
from aioembed.session.receiver import CLOSE_GRACE
from aioembed.session.sender import STOP_GRACE
from aioembed.testing import MockTransport, WriteFault

from .conftest import LAYOUT, assert_same, make_request, running, wait_pools_free

pytestmark = pytest.mark.anyio

FAST = TransferConfig(default_tokens=1024, pool_tokens=4096, input_timeout=0.5, round_timeout=0.5,
                      handshake_timeout=2.0, resume_reserve_tokens=0)


async def _until(pred: object, timeout: float = 5.0) -> None:
    assert callable(pred)
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.005)


async def _send_noting(sender: EmbeddingSender, room: str, request: dict[str, torch.Tensor],
                       outcome: list[BaseException]) -> None:
    """``send()``, its ``TransferError`` kept in ``outcome`` (the test's task group would re-raise it)."""
    try:
        await sender.send(room, request)
    except TransferError as exc:
        outcome.append(exc)


async def test_receiver_cancel_before_send_fails_the_later_send_fast() -> None:
    async with running(FAST) as (sender, [receiver]):
        handle = receiver.start("gone")
        await _until(lambda: sender.rooms_in_flight == 1)
        handle.cancel("user gave up")
        assert await handle.wait() is TransferStatus.ABORTED
        with pytest.raises(TransferAborted, match="user gave up"):
            await handle.result()
        await _until(lambda: sender.rooms_in_flight == 0)
        with anyio.fail_after(1.0), pytest.raises(TransferAborted, match="ended by the receiver"):
            await sender.send("gone", make_request(10, 1))
        await wait_pools_free(sender, receiver)


async def test_a_second_cancel_keeps_the_first_reason_on_both_sides() -> None:
    """``cancel()`` twice (a scheduler's deadline, then the caller's own clean-up): the room ended with the first;
    the caller's error and the ABORT the sender got (the reason its later ``send()`` gives) named the
    last one instead."""
    async with running(FAST) as (sender, [receiver]):
        handle = receiver.start("twice")
        await _until(lambda: sender.rooms_in_flight == 1)  # INIT there: the room's end is an ABORT
        handle.cancel("scheduler deadline passed")
        handle.cancel("caller cleaning up")
        with pytest.raises(TransferAborted, match="scheduler deadline passed"):
            await handle.result()
        await _until(lambda: sender.rooms_in_flight == 0)
        with anyio.fail_after(1.0), pytest.raises(TransferAborted, match="ended by the receiver") as info:
            await sender.send("twice", make_request(10, 1))
        assert "scheduler deadline passed" in str(info.value) and "cleaning up" not in str(info.value)
        await wait_pools_free(sender, receiver)


async def test_a_second_abort_by_the_sender_keeps_the_first_reason() -> None:
    """``abort()`` twice before a rank asked: a rank asking later was told the second reason, while one that had
    asked already (the room in flight, ended by the first) was told the first."""
    async with running(FAST) as (sender, [receiver]):
        sender.abort("dropped", "encoder failed on the image")
        sender.abort("dropped", "request cleaned up")
        with anyio.fail_after(5.0), pytest.raises(TransferAborted, match="encoder failed on the image") as info:
            await receiver.receive("dropped")
        assert "cleaned up" not in str(info.value)
        await wait_pools_free(sender, receiver)


async def test_a_room_retried_after_an_allocate_timeout_is_served() -> None:
    """A room given up before its INIT leaves nothing behind that could fail its retry: the retry starts at once
    (the id is not held), waits for memory like the first attempt, and a send() that comes meanwhile is the
    retry's. (Telling the sender of the give-up would race this: README, "Reservations and the order of
    requests".)"""
    cfg = FAST.replace(pool_tokens=1024, input_timeout=30.0, round_timeout=0.5)
    async with running(cfg) as (sender, [receiver]):
        hog = receiver.start("hog")
        await _until(lambda: hog.status is TransferStatus.WAITING_FOR_INPUT)
        with pytest.raises(TransferTimeout) as info:
            await receiver.receive("x")
        assert info.value.phase == "allocate"
        retry = receiver.start("x")  # at once
        src = make_request(300, 3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "x", src)
            await anyio.sleep(0.2)  # the send() waits for the retry's INIT, which waits for memory
            hog.cancel()
            got = await retry.result()
        assert_same(got.tensors, src)
        await hog.wait()
        await _until(lambda: sender.rooms_in_flight == 0)
        await wait_pools_free(sender, receiver)


async def test_receiver_cancel_mid_room_aborts_the_sender() -> None:
    """The room stalls between rounds (pool full); the receiver cancels; send() ends aborted."""
    async with running(FAST.replace(input_timeout=30.0, round_timeout=30.0)) as (sender, [receiver]):
        hog = await _stalled_between_rounds(sender, receiver, "r")
        handle = receiver.start("r", zero_copy=True)
        outcome: list[BaseException] = []

        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_noting, sender, "r", make_request(3000, 2), outcome)
            await _until(lambda: handle.status is TransferStatus.TRANSFERRING)
            handle.cancel("scheduler preempted the request")
        assert isinstance(outcome[0], TransferAborted)
        assert "preempted" in str(outcome[0])
        assert await handle.wait() is TransferStatus.ABORTED
        hog.cancel()  # type: ignore[attr-defined]
        await _until(lambda: receiver.rooms_in_flight == 0 and sender.rooms_in_flight == 0)
        await wait_pools_free(sender, receiver)


async def _stalled_between_rounds(sender: EmbeddingSender, receiver: EmbeddingReceiver, room: str) -> object:
    """Fill the pool with a hog room so that ``room`` stalls waiting for blocks after round 0.

    Rounds shrink to what is free, so a copying room always goes on; a zero-copy room keeps its
    blocks, so with the hog the pool is truly full and it must wait (with no slice of the pool
    kept for resume rounds, ``resume_reserve_tokens=0``).
    """
    assert receiver.config.resume_reserve == 0
    hog = receiver.start("hog", expected_tokens=3072)  # 3072 of the 4096-token pool
    await _until(lambda: hog.status is TransferStatus.WAITING_FOR_INPUT)
    return hog


async def test_cancelling_receive_call_aborts_both_sides() -> None:
    async with running(FAST.replace(input_timeout=30.0, round_timeout=30.0)) as (sender, [receiver]):
        hog = await _stalled_between_rounds(sender, receiver, "c")
        src = make_request(3000, 3)
        outcome: list[BaseException] = []

        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_noting, sender, "c", src, outcome)
            with anyio.move_on_after(0.3):
                await receiver.receive_leased("c")  # round 0 arrives, then it waits for blocks
        assert outcome and isinstance(outcome[0], TransferAborted), outcome
        assert "receive_leased() was cancelled" in str(outcome[0])
        hog.cancel()  # type: ignore[attr-defined]
        await _until(lambda: receiver.rooms_in_flight == 0 and sender.rooms_in_flight == 0)
        await wait_pools_free(sender, receiver)


async def test_cancelling_send_aborts_the_receiver_even_while_it_waits_for_memory() -> None:
    async with running(FAST.replace(input_timeout=30.0, round_timeout=30.0)) as (sender, [receiver]):
        hog = await _stalled_between_rounds(sender, receiver, "s")
        handle = receiver.start("s", zero_copy=True)
        with anyio.move_on_after(0.3):
            await sender.send("s", make_request(3000, 4))
        with anyio.fail_after(2):  # not after round_timeout: the abort interrupts the wait
            assert await handle.wait() is TransferStatus.ABORTED
        with pytest.raises(TransferAborted, match="cancelled"):
            await handle.result()
        hog.cancel()  # type: ignore[attr-defined]
        await _until(lambda: receiver.rooms_in_flight == 0 and sender.rooms_in_flight == 0)
        await wait_pools_free(sender, receiver)


async def test_receiver_input_timeout_names_the_phase() -> None:
    async with running(FAST) as (sender, [receiver]):
        with pytest.raises(TransferTimeout) as info:
            await receiver.receive("nobody-sends")
        assert info.value.phase == "input"
        assert "input" in str(info.value)
        await _until(lambda: sender.rooms_in_flight == 0)  # the sender dropped the reservation
        await wait_pools_free(sender, receiver)


async def test_sender_init_timeout_names_the_phase() -> None:
    async with running(FAST) as (sender, [receiver]):
        with pytest.raises(TransferTimeout) as info:
            await sender.send("nobody-receives", make_request(100, 5))
        assert info.value.phase == "init"
        await wait_pools_free(sender, receiver)


async def test_allocation_timeout_when_pool_stays_full() -> None:
    cfg = FAST.replace(pool_tokens=1024, input_timeout=30.0)
    async with running(cfg) as (sender, [receiver]):
        hog = receiver.start("hog")  # takes the whole pool and waits for data
        await _until(lambda: hog.status is TransferStatus.WAITING_FOR_INPUT)
        with pytest.raises(TransferTimeout) as info:
            await receiver.receive("starved")
        assert info.value.phase == "allocate"
        hog.cancel()
        await hog.wait()
        await _until(lambda: sender.rooms_in_flight == 0)
        await wait_pools_free(sender, receiver)


async def test_a_first_reservation_stuck_behind_rooms_their_senders_have_not_started_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """The head-of-line block: rooms started here hold the pool while their encoder is busy with a room that waits
    here for memory. Nothing moves until a timeout; the error, and one warning as it gives up, say what holds the
    pool and what to do (README, "Reservations and the order of requests")."""
    cfg = FAST.replace(pool_tokens=2048, round_timeout=2.0, input_timeout=30.0)
    async with running(cfg) as (sender, [receiver]):
        later = [receiver.start(f"later{i}") for i in range(2)]  # the whole pool, for rooms not sent yet
        await _until(lambda: all(h.status is TransferStatus.WAITING_FOR_INPUT for h in later))
        outcome: list[BaseException] = []
        with caplog.at_level("WARNING", logger="aioembed.session.blocks"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_send_noting, sender, "now", make_request(100, 1), outcome)  # what the encoder sends
                with pytest.raises(TransferTimeout) as info:
                    await receiver.receive("now")
                sender.abort("now")
        assert info.value.phase == "allocate"
        assert ("16 of the pool's 16 blocks are first reservations of 2 room(s) whose sender has sent nothing yet"
                in str(info.value)), info.value
        notes = [r for r in caplog.records if "gave up waiting for 1024 tokens of pool memory" in r.getMessage()]
        assert len(notes) == 1 and "first reservations of 2 room(s)" in notes[0].getMessage(), caplog.text
        assert outcome and isinstance(outcome[0], TransferError)
        for h in later:
            h.cancel()
            await h.wait()
        await _until(lambda: sender.rooms_in_flight == 0)
        await wait_pools_free(sender, receiver)


async def test_a_first_reservation_that_waits_behind_unreleased_leases_says_so() -> None:
    cfg = FAST.replace(pool_tokens=2048, round_timeout=1.0, input_timeout=30.0)
    async with running(cfg) as (sender, [receiver]):
        leases = []
        for i in range(2):
            src = make_request(1000, 10 + i)
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, f"held{i}", src)
                leases.append(await receiver.receive_leased(f"held{i}"))  # kept, not released: 8 blocks each
        with pytest.raises(TransferTimeout) as info:
            await receiver.receive("starved")
        assert info.value.phase == "allocate"
        assert "16 of the pool's 16 blocks hold rows that arrived and are not released yet" in str(info.value), \
            info.value
        assert "first reservations" not in str(info.value)
        for lease in leases:
            lease.release()
        await _until(lambda: sender.rooms_in_flight == 0)
        await wait_pools_free(sender, receiver)


async def test_incompatible_layout_is_refused_with_the_difference() -> None:
    other = Layout(embeddings=Field((32,), torch.bfloat16), token_ids=Field((), torch.int32),
                   mrope_positions=Field((3,), torch.int64))
    async with EmbeddingSender(LAYOUT, FAST) as sender, \
            EmbeddingReceiver(other, FAST, connect=sender.address) as receiver:
        with pytest.raises(IncompatiblePeer, match="layout fingerprint"):
            await receiver.receive("x")
        assert receiver.allocator.stats.free == receiver.allocator.stats.total


async def test_rooms_refused_by_one_handshake_each_get_their_own_error_naming_them() -> None:
    """The refusal is the connection's, one for every room that waits for that handshake: raised as it was, every
    room's error was one object (``room`` None, no room named; a stream's ``delivered`` set on it showed in the
    others), and each raise added the frames of its room (holding their ``out=`` buffers) to its one traceback."""
    other = Layout(embeddings=Field((32,), torch.bfloat16), token_ids=Field((), torch.int32),
                   mrope_positions=Field((3,), torch.int64))
    async with EmbeddingSender(LAYOUT, FAST) as sender, \
            EmbeddingReceiver(other, FAST, connect=sender.address) as receiver:
        errors: list[IncompatiblePeer] = []
        for room in ("a", "b", "c"):
            with pytest.raises(IncompatiblePeer, match="layout fingerprint") as info:
                await receiver.receive(room)
            errors.append(info.value)
        with pytest.raises(IncompatiblePeer, match="layout fingerprint") as info:
            await receiver.wait_connected()
        errors.append(info.value)
        assert len({id(e) for e in errors}) == len(errors), "rooms share one error object"
        assert [e.room for e in errors] == ["a", "b", "c", None]
        assert all(f"room {room!r}" in str(e) for room, e in zip("abc", errors, strict=False)), errors
        depths = {len(traceback.extract_tb(e.__traceback__)) for e in errors[:3]}
        assert len(depths) == 1, f"each room's traceback grew with the rooms refused before it: {depths}"


async def test_incompatible_block_size_is_refused() -> None:
    async with EmbeddingSender(LAYOUT, FAST) as sender, \
            EmbeddingReceiver(LAYOUT, FAST.replace(block_size=64), connect=sender.address) as receiver:
        with pytest.raises(IncompatiblePeer, match="block_size 64"):
            await receiver.wait_connected()


async def test_bad_send_arguments() -> None:
    async with running(FAST) as (sender, [receiver]):
        good = make_request(10, 6)
        bad_dtype = dict(good, token_ids=good["token_ids"].to(torch.int64))
        with pytest.raises(LayoutError, match="token_ids"):
            await sender.send("a", bad_dtype)
        uneven = dict(good, token_ids=good["token_ids"][:5])
        with pytest.raises(LayoutError, match="tokens"):
            await sender.send("a", uneven)
        with pytest.raises(InvalidRequest, match="max_metadata_bytes"):
            await sender.send("a", good, {"blob": b"x" * (FAST.max_metadata_bytes + 1)})
        with pytest.raises(InvalidRequest, match="msgpack"):
            await sender.send("a", good, {"obj": object()})
        with pytest.raises(InvalidRequest):
            await sender.send(1.5, good)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest):
            await sender.send("", good)
        with pytest.raises(InvalidRequest, match="tokens"):
            await sender.send("a", make_request(0, 1) if False else {k: v[:0] for k, v in good.items()})
        await wait_pools_free(sender, receiver)


async def test_bad_receive_arguments() -> None:
    async with running(FAST) as (sender, [receiver]):
        with pytest.raises(InvalidRequest):
            receiver.start(True)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="expected_tokens"):
            receiver.start("x", expected_tokens=0)
        h = receiver.start("dup")
        with pytest.raises(InvalidRequest, match="already"):
            receiver.start("dup")
        h.cancel()
        await h.wait()
        await wait_pools_free(sender, receiver)


async def test_bad_out_buffers_are_refused_before_anything_moves() -> None:
    """Each of these reached the transfer before (an internal IndexError mid-room, a raw AttributeError, or
    silently wrong rows: two fields sharing memory, or out= inside the receiver's own pool)."""
    def good(n: int = 64) -> dict[str, Any]:
        return {k: torch.empty((n, *f.shape), dtype=f.dtype) for k, f in LAYOUT.items()}

    async with running(FAST) as (sender, [receiver]):
        shared = torch.empty(64 * 3, dtype=torch.int64)
        pool = receiver.pool.tensors
        cases: list[tuple[dict[str, Any], str]] = [
            (dict(good(), token_ids=torch.tensor(5, dtype=torch.int32)), r"shape \(n,\), got torch.int32 \(\)"),
            (dict(good(), token_ids=[0] * 64), "must be a torch.Tensor, got list"),
            (dict(good(), mrope_positions=shared.view(64, 3), token_ids=shared.view(torch.int32)[:64]),
             r"out\['(token_ids|mrope_positions)'\] and out\['(token_ids|mrope_positions)'\] share memory"),
            ({k: pool[k][:64] for k in LAYOUT}, "the receiver's pool"),
            ([good()[k] for k in LAYOUT], "out= must map each field name to a tensor, got list"),  # type: ignore[list-item]
            ({k: good()[k] for k in ("embeddings", "token_ids")}, "out= needs exactly the fields"),
        ]
        for out, match in cases:
            with pytest.raises(InvalidRequest, match=match):
                receiver.start("bad", out=out)
        # the same buffers, apart: accepted, and the rows arrive
        src = make_request(40, 9)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "ok", src)
            got = await receiver.receive("ok", out=good())
        assert_same(got.tensors, src)
        await wait_pools_free(sender, receiver)


async def test_sender_closing_ends_pending_receiver_rooms() -> None:
    cfg = FAST.replace(input_timeout=30.0)
    stop = anyio.Event()

    async def serve(*, task_status: anyio.abc.TaskStatus[EmbeddingSender]) -> None:
        async with EmbeddingSender(LAYOUT, cfg) as s:
            task_status.started(s)
            await stop.wait()

    async with anyio.create_task_group() as tg:
        sender = await tg.start(serve)
        async with EmbeddingReceiver(LAYOUT, cfg, connect=sender.address) as receiver:
            handle = receiver.start("pending")
            await _until(lambda: sender.rooms_in_flight == 1)
            stop.set()  # the sender closes while the room waits for input
            assert await handle.wait() is TransferStatus.ABORTED
            with pytest.raises(TransferAborted, match="sender closing"):
                await handle.result()
            st = receiver.allocator.stats
            assert st.free == st.total and st.fenced == 0
        assert sender.rooms_in_flight == 0  # told and forgotten (it stayed in the room table after aclose())


async def test_a_write_that_never_ends_is_bounded_by_room_timeout_and_fenced() -> None:
    # send() awaited a transport write with no deadline: one write that never completed held it (and the
    # receiver's blocks) past room_timeout, past the receiver's ABORT (found by a reviewer).
    cfg = FAST.replace(input_timeout=30.0, round_timeout=30.0, room_timeout=1.0)
    hung = MockTransport(cancel_safe_writes=False, write_lifetime=0.3, faults=lambda call: WriteFault(delay=3600.0))
    async with EmbeddingSender(LAYOUT, cfg, transport=hung) as sender, \
            EmbeddingReceiver(LAYOUT, cfg.replace(room_timeout=30.0), connect=sender.address,
                              transport=MockTransport()) as receiver:  # the sender's deadline comes first
        await receiver.wait_connected()
        handle = receiver.start("r")
        t0 = anyio.current_time()
        with anyio.fail_after(5), pytest.raises(TransferTimeout, match="room_timeout") as caught:
            await sender.send("r", make_request(500, 1))
        assert caught.value.phase == "room" and anyio.current_time() - t0 < 3
        # The cancelled write may still land (the transport cannot cancel writes): the receiver was told to
        # fence its blocks, and gets them back once the writer says the write can no longer land.
        assert await handle.wait() is TransferStatus.FAILED
        await wait_pools_free(sender, receiver)


async def test_aclose_ends_a_send_whose_write_never_ends() -> None:
    cfg = FAST.replace(input_timeout=30.0, round_timeout=30.0)  # room_timeout stays 600 s
    hung = MockTransport(cancel_safe_writes=False, write_lifetime=0.3, faults=lambda call: WriteFault(delay=3600.0))
    async with EmbeddingReceiver(LAYOUT, cfg, transport=MockTransport()) as receiver:
        sender = EmbeddingSender(LAYOUT, cfg, transport=hung)
        await sender.__aenter__()
        outcome: list[BaseException] = []

        async def receive() -> None:
            with suppress(TransferError):
                await receiver.receive("r", sender=sender.address)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive)
                tg.start_soon(_send_noting, sender, "r", make_request(500, 1), outcome)
                await _until(lambda: sender.writes_in_flight == 1)
                with anyio.fail_after(CLOSE_GRACE + STOP_GRACE + 2):
                    await sender.aclose()
                tg.cancel_scope.cancel()
        finally:
            await sender.aclose()
        assert len(outcome) == 1 and isinstance(outcome[0], TransferAborted), outcome
        assert "sender closing" in str(outcome[0]) and sender.rooms_in_flight == 0


async def test_a_send_still_making_its_sources_as_the_sender_closes_is_aborted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # aclose() fails the rooms it sees; a send() still making its sources (a copy in a thread, a CUDA fence)
    # registered its room after that, held aclose() for its whole grace and then waited for its
    # input_timeout on a closed sender (found by a reviewer).
    cfg = FAST.replace(input_timeout=30.0, staging_tokens=0)
    async with EmbeddingSender(LAYOUT, cfg) as sender:
        making, go_on = anyio.Event(), anyio.Event()
        real = sender._sources_of

        async def slow_sources(*args: object) -> object:
            making.set()
            await go_on.wait()
            return await real(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(sender, "_sources_of", slow_sources)
        outcome: list[BaseException] = []

        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_noting, sender, "r", make_request(500, 1), outcome)
            await making.wait()

            async def close() -> None:
                with anyio.fail_after(1.0):  # nothing in flight: no grace to wait out
                    await sender.aclose()

            tg.start_soon(close)
            await _until(lambda: sender._closing)
            go_on.set()
        assert len(outcome) == 1 and isinstance(outcome[0], TransferAborted), outcome
        assert "sender closing" in str(outcome[0]) and sender.rooms_in_flight == 0


async def test_receiver_world_and_rank_validation() -> None:
    with pytest.raises(InvalidRequest):
        EmbeddingReceiver(LAYOUT, FAST, connect="tcp://127.0.0.1:1", rank=2, world=2)
    with pytest.raises(InvalidRequest):
        EmbeddingReceiver(LAYOUT, FAST, connect="tcp://127.0.0.1:1", rank=0, world=0)


async def test_sender_abort_tells_receivers_before_and_after_they_ask() -> None:
    async with running(FAST.replace(input_timeout=30.0)) as (sender, [receiver]):
        early = receiver.start("asked")
        await _until(lambda: sender.rooms_in_flight == 1)
        sender.abort("asked", "encoder could not decode the image")
        with anyio.fail_after(2), pytest.raises(TransferAborted, match="could not decode"):
            await early.result()
        sender.abort("later", "encoder out of memory")
        with anyio.fail_after(2), pytest.raises(TransferAborted, match="out of memory"):
            await receiver.receive("later")
        await wait_pools_free(sender, receiver)


async def test_a_room_id_is_reused_only_once_the_sender_acknowledged_its_abort() -> None:
    """A room aborted between rounds (waiting for pool memory: nothing announced, nothing fenced) could be
    retried at once: the sender still held the old attempt and refused the new INIT ("INIT after the room
    ended"), or its ABORT_ACK reached the new attempt ("ABORT_ACK without an ABORT"). Found by a review."""
    cfg = FAST.replace(block_size=16, default_tokens=224, max_round_tokens=224, pool_tokens=256,
                       resume_reserve_tokens=0, round_timeout=5.0)
    src = make_request(500, 3)
    async with running(cfg) as (sender, [receiver]):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_send_quietly, sender, "s", src)
            stream = receiver.stream("s", zero_copy=True, chunk_tokens=0)
            held = [await stream.__anext__(), await stream.__anext__()]  # the pool is full: the next round waits
            with anyio.fail_after(5):
                while receiver.allocator.stats.waiters == 0:
                    await anyio.sleep(0.001)
            await stream.aclose()  # ABORT to the sender; the chunks go back
            assert all(c.released for c in held) and receiver.fenced_blocks == {}
            try:
                handle = receiver.start("s")  # at once: the sender may not have answered yet
            except InvalidRequest as exc:
                assert "not yet acknowledged the abort" in str(exc)
                with anyio.fail_after(5):
                    while True:
                        await anyio.sleep(0.01)
                        try:
                            handle = receiver.start("s")
                            break
                        except InvalidRequest:
                            pass
            tg.start_soon(sender.send, "s", src)
            got = await handle.result()
        assert_same(got.tensors, src)
        await wait_pools_free(sender, receiver)


async def _send_quietly(sender: EmbeddingSender, room: str, src: dict[str, torch.Tensor]) -> None:
    with suppress(TransferError):
        await sender.send(room, src)


async def _waiting_driver(receiver: EmbeddingReceiver, room: str) -> tuple[Any, ReceiveRoomDriver]:
    """``room`` started on ``receiver``, its driver waiting for the sender's first word (INIT sent)."""
    handle = receiver.start(room)
    driver = receiver._rooms[room]
    assert isinstance(driver, ReceiveRoomDriver)
    await _until(lambda: handle.status is TransferStatus.WAITING_FOR_INPUT and driver._inbox._waiter is not None)
    return handle, driver


async def test_a_phase_deadline_that_fires_as_a_frame_arrives_names_its_phase() -> None:
    """The input (or round) deadline cancels the room's scope; a frame that came in the same loop turn wakes the wait
    first, and the cancellation lands at the room's next checkpoint (here: the round's copy, large enough for the
    copy threads), after the wait cleared its phase. The room then said "exceeded room_timeout=600.0 s" although
    only input_timeout had passed."""
    cfg = FAST.replace(default_tokens=32768, pool_tokens=65536, input_timeout=30.0, room_timeout=600.0)
    async with running(cfg) as (sender, [receiver]):
        handle, driver = await _waiting_driver(receiver, "late-frame")
        _, expire = receiver._deadlines._deadlines[handle]  # the input deadline's action, as its task calls it
        tokens = 32000  # over COPY_INLINE_BYTES: copied on the copy threads, not on the loop
        # The round's STATUS lands (rows as the pool holds them: only the error matters here)...
        driver.deliver(Status(room="late-frame", state=TransferStatus.SUCCESS, total_tokens=tokens,
                              sent_tokens=tokens, round=0, metadata={}))
        expire()  # ...and the input deadline passes in the same loop turn
        with anyio.fail_after(5):
            await handle.wait()
        with pytest.raises(TransferTimeout) as info:
            await handle.result()
        assert info.value.phase == "input", info.value
        assert "room_timeout" not in str(info.value)
        sender.abort("late-frame")  # it never sent the room (the STATUS above was ours): its INIT is still there
        await wait_pools_free(sender, receiver)


async def test_a_sender_flooding_a_room_fails_it_as_a_protocol_violation() -> None:
    """More frames for a room than the protocol lets a sender queue is the sender breaking the protocol, as any
    bad frame: the room fails (``TransferFailed``, status FAILED, counted as failed), not "aborted" as if someone
    had cancelled it, and the sender is told (ABORT) so its blocks come back."""
    async with running(FAST.replace(input_timeout=30.0)) as (sender, [receiver]):
        handle, driver = await _waiting_driver(receiver, "flooded")
        for _ in range(driver._inbox._capacity + 1):  # in one loop turn: the room takes none of them meanwhile
            driver.deliver(FenceRelease(room="flooded"))
        with anyio.fail_after(5):
            await handle.wait()
        with pytest.raises(TransferFailed, match="more messages than the protocol allows") as info:
            await handle.result()
        assert not isinstance(info.value, TransferAborted)
        assert "flooded" in str(info.value) and sender.address in str(info.value)
        assert handle.status is TransferStatus.FAILED
        await wait_pools_free(sender, receiver)


async def test_a_sender_flooding_a_room_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Every frame past the room's inbox logged an ERROR until the room's task ran and closed it: frames come a
    batch at a time (up to 256), so one burst of a flooding sender wrote a line per frame (50 here), unbudgeted.
    The room's failure says it once."""
    async with running(FAST.replace(input_timeout=30.0)) as (sender, [receiver]):
        handle, driver = await _waiting_driver(receiver, "flooded")
        with caplog.at_level("DEBUG", logger="aioembed.session.receiver"):
            for _ in range(driver._inbox.capacity + 50):  # in one loop turn, as one batch of the channel
                driver.deliver(FenceRelease(room="flooded"))
            with anyio.fail_after(5):
                await handle.wait()
        said = [r for r in caplog.records if "flooded the room" in r.getMessage()]
        assert [r.levelname for r in said] == ["ERROR"] + ["DEBUG"] * 49, [r.levelname for r in said]
        await wait_pools_free(sender, receiver)


async def test_running_out_of_memory_for_a_fresh_output_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """``receive()`` without ``out=`` makes its output once the total is known. Out of memory there (torch's own
    error: a CPU allocation's RuntimeError, a CUDA one's OutOfMemoryError) is no bug of the library: the room
    failed with "internal error" and an ERROR traceback. It says what it could not allocate and what to do; the
    blocks still come back and the sender is told."""
    def no_memory(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        torch.empty(1 << 62, dtype=torch.uint8)  # what the allocator raises for a request it cannot serve
        raise AssertionError("unreachable")

    async with running(FAST) as (sender, [receiver]):
        monkeypatch.setattr(receiver.outputs, "empty", no_memory)
        outcome: list[BaseException] = []
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_send_noting, sender, "big", make_request(1500, 7), outcome)
                with pytest.raises(TransferFailed) as info:
                    await receiver.receive("big")
        message = str(info.value)
        assert "internal error" not in message, message
        assert "out of memory" in message and "1500 tokens" in message and "out=" in message, message
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        # The sender ended too: its send() returned (every row written before the receiver copied) or was told.
        assert all(isinstance(e, TransferError) for e in outcome), outcome
        await wait_pools_free(sender, receiver)
        # Parts make their output at start(): the same error there, not torch's bare RuntimeError.
        with pytest.raises(TransferFailed, match="out of memory"):
            receiver.start("parts", parts=[Part(sender.address, 0, 100)])
        assert receiver.rooms_in_flight == 0


async def test_bad_parts_and_metadata_arguments_are_refused_as_invalid_requests() -> None:
    """Arguments of the wrong type escaped as Python's own TypeError: ``parts=`` given as a generator or a number
    (``len()`` of it; a generator is now taken), ``metadata=`` not a mapping (``dict()`` of it, reported as a
    failure preparing the request's *rows*), a timeout that is not a number."""
    async with running(FAST) as (sender, [receiver]):
        def parts_gen() -> Any:
            yield Part(sender.address, 0, 10)

        handle = receiver.start("g", parts=parts_gen())  # any iterable of parts (a generator is read once)
        handle.cancel()
        with pytest.raises(TransferAborted):
            await handle.result()
        with pytest.raises(InvalidRequest, match="parts"):
            receiver.start("n", parts=5)  # type: ignore[arg-type]
        assert receiver.rooms_in_flight == 0
        for bad in (5, [("a", 1)], "text"):
            with pytest.raises(InvalidRequest, match="metadata"):
                await sender.send("m", make_request(4, 1), bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="timeout"):
            await receiver.wait_connected("5")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="timeout"):
            await sender.wait_for_receivers(1, timeout="5")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="count"):
            await sender.wait_for_receivers("1")  # type: ignore[arg-type]
        await wait_pools_free(sender, receiver)
