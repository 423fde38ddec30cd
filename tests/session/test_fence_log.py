"""Fence log lines: one per room, a burst summed up (the rooms still at DEBUG, every block in the metrics)."""

from __future__ import annotations

import logging
import time

import anyio
import pytest

from aioembed import TransferConfig
from aioembed.memory.allocator import BlockAllocator
from aioembed.metrics import TransferObserver
from aioembed.protocol.ownership import Fence, FenceReason, Free, GrantState, Proof, Writer
from aioembed.session import fence_log
from aioembed.session.block_keeper import BlockKeeper
from aioembed.session.fence_log import FenceLog

from .conftest import running, wait_pools_free

LOG = logging.getLogger("test.fence_log")
WRITER = Writer("s" * 16, 1, address="tcp://10.0.0.1:5000")
OTHER = Writer("t" * 16, 1, address="tcp://10.0.0.2:5000")


def fence(room: str, blocks: int = 2, reason: FenceReason = FenceReason.SESSION_DROPPED,
          writer: Writer = WRITER) -> Fence:
    return Fence(grant=hash(room) & 0xFFFF, room=room, blocks=tuple(range(blocks)), reason=reason, writer=writer)


def released(room: str, blocks: int = 2) -> Free:
    return Free(grant=1, room=room, blocks=tuple(range(blocks)), proof=Proof.ABORT_ACK, was=GrantState.FENCED,
                writer=WRITER)


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name and r.levelno == level]


def test_a_lone_fence_is_one_full_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    fl = FenceLog(LOG, "receiver[0]", window=10.0)
    fl.fenced(fence("a", blocks=3), now=100.0)
    assert lines(caplog, logging.WARNING) == [
        f"receiver[0]: room='a': 3 blocks fenced: {FenceReason.SESSION_DROPPED.value} ({WRITER})"]
    assert fl.next_due() == 110.0
    fl.flush(110.0)  # nothing followed it: no summary
    assert len(lines(caplog, logging.WARNING)) == 1
    assert fl.next_due() is None


def test_a_burst_is_its_first_line_and_one_summary(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    fl = FenceLog(LOG, "receiver[0]", window=10.0)
    for i in range(1000):
        fl.fenced(fence(f"r{i}"), now=100.0 + i * 0.001)
    warnings = lines(caplog, logging.WARNING)
    assert warnings == [f"receiver[0]: room='r0': 2 blocks fenced: {FenceReason.SESSION_DROPPED.value} ({WRITER})"]
    debug = lines(caplog, logging.DEBUG)
    assert len(debug) == 999 and "room='r999'" in debug[-1] and "after room='r0'" in debug[-1]
    fl.flush(109.9)  # the window is still open
    assert len(lines(caplog, logging.WARNING)) == 1
    fl.flush(110.0)
    summary = lines(caplog, logging.WARNING)[1]
    assert "1998 more blocks fenced in the 10 s after room='r0' (999 other rooms)" in summary
    assert FenceReason.SESSION_DROPPED.value in summary and str(WRITER) in summary
    assert fl.next_due() is None
    fl.fenced(fence("later"), now=111.0)  # a new burst starts with a full line
    assert lines(caplog, logging.WARNING)[-1].startswith("receiver[0]: room='later': 2 blocks fenced")


def test_reasons_and_writers_are_separate_bursts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    fl = FenceLog(LOG, "receiver[0]", window=10.0)
    fl.fenced(fence("a"), now=0.0)
    fl.fenced(fence("b", reason=FenceReason.ABORT_UNACKED), now=0.1)
    fl.fenced(fence("c", writer=OTHER), now=0.2)
    fl.fenced(fence("d"), now=0.3)  # same reason and writer as "a": summed up
    warnings = lines(caplog, logging.WARNING)
    assert [w.split(":")[1].strip() for w in warnings] == ["room='a'", "room='b'", "room='c'"]
    assert str(OTHER) in warnings[2]
    fl.close()  # every open burst is summed up, due or not
    warnings = lines(caplog, logging.WARNING)
    assert len(warnings) == 4 and "2 more blocks fenced in the 10 s after room='a' (1 other room)" in warnings[3]
    assert fl.next_due() is None
    fl.fenced(fence("e"), now=0.4)  # after close nothing would sum a burst up: every line in full
    fl.fenced(fence("f"), now=0.5)
    assert [w.split(":")[1].strip() for w in lines(caplog, logging.WARNING)[4:]] == ["room='e'", "room='f'"]
    assert fl.next_due() is None


def test_a_room_with_several_grants_counts_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    fl = FenceLog(LOG, "receiver[0]", window=10.0)
    fl.fenced(fence("a", blocks=2), now=0.0)
    fl.fenced(fence("a", blocks=3), now=0.1)  # its second round's grant
    fl.fenced(fence("b", blocks=1), now=0.2)
    fl.fenced(fence("b", blocks=1), now=0.3)
    fl.flush(10.0)
    assert "5 more blocks fenced in the 10 s after room='a' (1 other room)" in lines(caplog, logging.WARNING)[1]


def test_a_due_burst_is_summed_up_before_the_next_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    fl = FenceLog(LOG, "receiver[0]", window=1.0)
    fl.fenced(fence("a"), now=0.0)
    fl.fenced(fence("b"), now=0.5)
    fl.fenced(fence("c", writer=OTHER), now=2.0)  # after a's window: its summary comes first
    warnings = lines(caplog, logging.WARNING)
    assert "room='a'" in warnings[0] and "after room='a' (1 other room)" in warnings[1] and "room='c'" in warnings[2]


def test_releases_of_fenced_blocks_are_info_bursts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOG.name)
    fl = FenceLog(LOG, "receiver[0]", window=10.0)
    for i in range(5):
        fl.released(released(f"r{i}", blocks=4), now=float(i))
    infos = lines(caplog, logging.INFO)
    assert infos == [f"receiver[0]: room='r0': 4 fenced blocks released: {Proof.ABORT_ACK.value} ({WRITER})"]
    assert lines(caplog, logging.DEBUG)[0].startswith(
        "receiver[0]: room='r1': 4 fenced blocks released (in the burst after room='r0')")
    fl.flush(10.0)
    infos = lines(caplog, logging.INFO)
    assert len(infos) == 2 and "16 more fenced blocks released in the 10 s after room='r0' (4 other rooms)" in infos[1]
    assert not lines(caplog, logging.WARNING)


@pytest.mark.anyio
async def test_the_keeper_sums_a_burst_up_when_its_window_ends_and_a_stall_is_one_stall(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper's timer sums a burst up on time; a stall its heartbeat reported first (``stalled``)
    sums up what came due meanwhile, so the timer does not take that deadline for a second stall."""
    caplog.set_level(logging.DEBUG, "aioembed.session.blocks")
    monkeypatch.setattr(fence_log, "BURST_WINDOW", 0.2)
    keeper = BlockKeeper(BlockAllocator(num_blocks=8, block_size=16), name="receiver[0]",
                         observer=TransferObserver(), stall_tolerance=0.3)

    def summaries() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "aioembed.session.blocks" and "in the 0.2 s after" in r.getMessage()]

    async with anyio.create_task_group() as tg:
        tg.start_soon(keeper.run_timers)
        await anyio.sleep(0.01)
        now = anyio.current_time()
        for room in ("a", "b", "c"):
            keeper.fence_log.fenced(fence(room), now)
        keeper.timer.wake()
        with anyio.fail_after(5):
            while not summaries():
                await anyio.sleep(0.02)
        assert "4 more blocks fenced in the 0.2 s after room='a' (2 other rooms)" in summaries()[0]
        now = anyio.current_time()
        keeper.fence_log.fenced(fence("d"), now)
        keeper.fence_log.fenced(fence("e"), now)
        keeper.timer.wake()
        await anyio.sleep(0.01)
        time.sleep(1.0)  # noqa: ASYNC251  (the point: the loop stalls past the window and the tolerance)
        keeper.stalled(anyio.current_time())  # as a connection's heartbeat check reports it
        await anyio.sleep(0.3)
        assert len(summaries()) == 2 and "after room='d' (1 other room)" in summaries()[1]
        assert keeper.timer.watch.stalls == 0
        assert not [r for r in caplog.records if "the event loop stalled" in r.getMessage()]
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_cancelling_many_waiting_receives_logs_a_burst_not_a_line_per_room(
        caplog: pytest.LogCaptureFixture) -> None:
    """200 receives whose INIT reached the sender, cancelled at once: every room's blocks are fenced
    (the writer might be writing) and come back with its ABORT_ACK; the log has the first room and one
    summary per kind, and the counters have every block."""
    caplog.set_level(logging.DEBUG, "aioembed.session.blocks")
    rooms = 200
    cfg = TransferConfig(block_size=16, default_tokens=16, pool_tokens=16 * rooms, resume_reserve_tokens=0,
                         input_timeout=30.0)
    async with running(cfg) as (sender, [receiver]):
        async with anyio.create_task_group() as tg:
            for i in range(rooms):
                tg.start_soon(receiver.receive, f"idle-{i}")
            with anyio.fail_after(10):
                while sender.rooms_in_flight < rooms:  # every INIT arrived: the writer has the addresses
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        await wait_pools_free(sender, receiver)
        fenced = receiver.keeper.fenced_total[FenceReason.ABORT_UNACKED.name]
        assert fenced == rooms * receiver.keeper.allocator.blocks_for(16)
        assert receiver.keeper.released_total[Proof.ABORT_ACK.name] == fenced
    blocks = [r for r in caplog.records if r.name == "aioembed.session.blocks"]
    full = [r.getMessage() for r in blocks if r.levelno == logging.WARNING and "1 block fenced:" in r.getMessage()]
    summaries = [r.getMessage() for r in blocks if r.levelno >= logging.INFO and "s after room=" in r.getMessage()]
    assert len(full) == 1 and FenceReason.ABORT_UNACKED.value in full[0]
    # The receiver's close sums up what is still open: both bursts, every room counted.
    assert sorted(int(s.split("(")[1].split()[0]) for s in summaries) == [rooms - 1, rooms - 1]
    per_room = [r for r in blocks if r.levelno == logging.DEBUG and "in the burst after" in r.getMessage()]
    assert len(per_room) == 2 * (rooms - 1)
