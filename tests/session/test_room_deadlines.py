"""One task keeps every room's deadlines (``RoomDeadlines``): what comes due is called at its time, what is
dropped or moved is not, and setting and dropping deadlines does not wake the task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sniffio

from aioembed import TransferConfig
from aioembed.session.room_deadlines import RoomDeadlines

from .conftest import make_request, running

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def kept() -> AsyncIterator[RoomDeadlines]:
    deadlines = RoomDeadlines()
    async with anyio.create_task_group() as tg:
        tg.start_soon(deadlines.run)
        await anyio.lowlevel.checkpoint()  # the task sleeps with nothing set
        yield deadlines
        tg.cancel_scope.cancel()


def recorder(log: list[tuple[str, float]], name: str) -> Callable[[], None]:
    return lambda: log.append((name, anyio.current_time()))


async def test_a_deadline_calls_its_action_at_its_time_and_is_forgotten() -> None:
    log: list[tuple[str, float]] = []
    async with kept() as deadlines:
        due = anyio.current_time() + 0.02
        deadlines.set("a", due, recorder(log, "a"))
        with anyio.fail_after(5):
            while not log:
                await anyio.sleep(0.01)
        assert [name for name, _ in log] == ["a"]
        assert due <= log[0][1] < due + 1.0  # at its time (a loaded machine may run the task late, never early)
        assert len(deadlines) == 0 and deadlines.expired == 1


async def test_a_dropped_deadline_is_never_called_and_a_moved_one_only_at_its_new_time() -> None:
    log: list[tuple[str, float]] = []
    async with kept() as deadlines:
        now = anyio.current_time()
        deadlines.set("dropped", now + 0.01, recorder(log, "dropped"))
        deadlines.set("moved", now + 0.01, recorder(log, "moved early"))
        deadlines.drop("dropped")
        deadlines.set("moved", now + 0.04, recorder(log, "moved"))
        deadlines.drop("never set")  # nothing happens
        await anyio.sleep(0.025)
        assert log == []
        with anyio.fail_after(5):
            while not log:
                await anyio.sleep(0.01)
        await anyio.sleep(0.03)
        assert [name for name, _ in log] == ["moved"]
        assert log[0][1] >= now + 0.04


async def test_an_earlier_deadline_wakes_the_task_sleeping_towards_a_later_one() -> None:
    log: list[tuple[str, float]] = []
    async with kept() as deadlines:
        now = anyio.current_time()
        deadlines.set("late", now + 10.0, recorder(log, "late"))
        await anyio.sleep(0.005)  # the task now sleeps towards the late one
        deadlines.set("soon", now + 0.02, recorder(log, "soon"))
        with anyio.fail_after(5):
            while not log:
                await anyio.sleep(0.01)
        assert [name for name, _ in log] == ["soon"]
        assert log[0][1] >= now + 0.02
        assert len(deadlines) == 1


async def test_rooms_setting_and_dropping_deadlines_do_not_wake_the_task() -> None:
    """The point of the task: a room sets and drops its deadlines long before they come due, and none of that
    costs a wake-up (or a timer of the loop). The task looks again only when what it slept towards comes."""
    async with kept() as deadlines:
        scans = deadlines.scans
        deadlines.set("first", anyio.current_time() + 30.0, lambda: None)
        with anyio.fail_after(1):
            while deadlines.scans == scans:  # the first deadline wakes the task (trio runs it in its own order)
                await anyio.lowlevel.checkpoint()
        assert deadlines.scans == scans + 1  # it now sleeps towards the first deadline
        for room in range(1000):
            deadlines.set(room, anyio.current_time() + 30.0, lambda: None)
            deadlines.set(("phase", room), anyio.current_time() + 30.0, lambda: None)
            deadlines.drop(("phase", room))
            deadlines.drop(room)
            if room % 100 == 0:
                await anyio.lowlevel.checkpoint()
        assert deadlines.scans == scans + 1 and deadlines.expired == 0 and len(deadlines) == 1


async def test_after_a_dropped_deadline_the_next_one_still_comes_on_time() -> None:
    """The task sleeps towards a deadline that is then dropped: it wakes then for nothing, and sleeps on towards
    the next one, which is called at its time."""
    log: list[tuple[str, float]] = []
    async with kept() as deadlines:
        now = anyio.current_time()
        deadlines.set("armed", now + 0.01, recorder(log, "armed"))
        deadlines.set("next", now + 0.03, recorder(log, "next"))
        await anyio.lowlevel.checkpoint()
        deadlines.drop("armed")
        with anyio.fail_after(5):
            while not log:
                await anyio.sleep(0.01)
        assert [name for name, _ in log] == ["next"]
        assert log[0][1] >= now + 0.03


async def test_an_action_that_raises_is_logged_and_the_other_deadlines_still_come(
        caplog: pytest.LogCaptureFixture) -> None:
    log: list[tuple[str, float]] = []

    def broken() -> None:
        raise RuntimeError("a bug in an action")

    async with kept() as deadlines:
        now = anyio.current_time()
        deadlines.set("broken", now + 0.01, broken)
        deadlines.set("after", now + 0.03, recorder(log, "after"))
        with anyio.fail_after(5):
            while not log:
                await anyio.sleep(0.01)
    assert [name for name, _ in log] == ["after"]
    assert "'broken': its action failed" in caplog.text and "a bug in an action" in caplog.text


async def test_an_action_that_moves_or_drops_another_due_deadline_is_heeded() -> None:
    """Deadlines that came due together are called in turn; one that an earlier action dropped is not called,
    one it moved later is called at its new time."""
    log: list[tuple[str, float]] = []
    async with kept() as deadlines:
        now = anyio.current_time()

        def first() -> None:
            log.append(("first", anyio.current_time()))
            deadlines.drop("dropped")
            deadlines.set("moved", anyio.current_time() + 0.03, recorder(log, "moved"))

        deadlines.set("first", now + 0.01, first)
        deadlines.set("dropped", now + 0.01, recorder(log, "dropped"))
        deadlines.set("moved", now + 0.01, recorder(log, "moved early"))
        with anyio.fail_after(5):
            while len(log) < 2:
                await anyio.sleep(0.01)
    assert [name for name, _ in log] == ["first", "moved"]
    assert log[1][1] >= log[0][1] + 0.03


async def test_a_room_makes_no_event_loop_timer_of_its_own(anyio_backend: Any) -> None:
    """Each room used to make and cancel three or four loop timers (its deadlines, each wait's), microseconds of
    the loop per small request. Counted on asyncio's own loop, where timers can be counted."""
    if sniffio.current_async_library() != "asyncio" or type(asyncio.get_running_loop()).__module__ != (
            "asyncio.unix_events"):
        pytest.skip("counts the timers of asyncio's own event loop")
    loop = asyncio.get_running_loop()
    cfg = TransferConfig(default_tokens=256, pool_tokens=4096, heartbeat_interval=30.0)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(64, seed=1)
        for warm in range(3):  # handshakes and first-use set-up out of the count
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, f"warm{warm}", src)
                await receiver.receive(f"warm{warm}")
        timers: list[float] = []
        real_call_at = loop.call_at

        def call_at(when: float, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
            timers.append(when)
            return real_call_at(when, *args, **kwargs)

        loop.call_at = call_at  # type: ignore[method-assign]
        try:
            rooms = 40
            for i in range(rooms):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender.send, f"room{i}", src)
                    got = await receiver.receive(f"room{i}")
                assert got.num_tokens == 64
        finally:
            del loop.call_at
    assert len(timers) < rooms // 4, f"{len(timers)} loop timers for {rooms} rooms"
