"""The receiving room's inbox: order, bounds, closing, and no item lost to a cancelled wait."""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aioembed.session.room_inbox import RoomInbox

pytestmark = pytest.mark.anyio


async def test_items_come_out_in_order_and_a_full_inbox_refuses_more() -> None:
    inbox = RoomInbox[int](3)
    for i in range(3):
        inbox.put(i)
    with pytest.raises(anyio.WouldBlock):
        inbox.put(3)
    assert len(inbox) == 3
    assert [inbox.get_nowait(), await inbox.get(), inbox.get_nowait()] == [0, 1, 2]
    with pytest.raises(anyio.WouldBlock):
        inbox.get_nowait()
    inbox.put(4)  # room again once taken
    assert inbox.get_nowait() == 4


async def test_a_waiting_get_gets_the_next_item() -> None:
    inbox = RoomInbox[str](2)
    got: list[str] = []

    async def consume() -> None:
        got.append(await inbox.get())

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        inbox.put("status")
    assert got == ["status"]
    assert len(inbox) == 0


async def test_what_was_queued_before_close_can_still_be_taken() -> None:
    inbox = RoomInbox[str](4)
    inbox.put("progress")
    inbox.put("status")
    inbox.close()
    with pytest.raises(anyio.ClosedResourceError):
        inbox.put("late")
    assert inbox.get_nowait() == "progress"
    assert await inbox.get() == "status"
    with pytest.raises(anyio.WouldBlock):
        inbox.get_nowait()
    with pytest.raises(anyio.EndOfStream):
        await inbox.get()


async def test_close_wakes_a_waiting_get() -> None:
    inbox = RoomInbox[str](1)
    ended: list[BaseException] = []

    async def consume() -> None:
        try:
            await inbox.get()
        except anyio.EndOfStream as exc:
            ended.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        inbox.close()
    assert len(ended) == 1


async def test_one_consumer_only() -> None:
    inbox = RoomInbox[str](1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(inbox.get)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="one consumer"):
            await inbox.get()
        inbox.put("x")


def test_an_inbox_needs_room_for_one_event() -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        RoomInbox[str](0)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # a plain Task.cancel() is asyncio's
async def test_an_item_put_as_the_waiting_task_is_cancelled_stays_first_in_line() -> None:
    """``put`` ends the wait, then a plain ``Task.cancel()`` reaches the task before it resumes: the
    cancellation is raised at the wait, and the item must still be in the inbox (an anyio memory object
    stream loses it: it had handed the item to the cancelled receiver)."""
    inbox = RoomInbox[str](2)
    task = asyncio.ensure_future(inbox.get())
    await anyio.wait_all_tasks_blocked()
    inbox.put("status")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert inbox.get_nowait() == "status"
    inbox.put("next")  # and the inbox still works: no consumer is left registered
    assert await inbox.get() == "next"
