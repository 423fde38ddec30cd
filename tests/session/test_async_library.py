"""Under a plain ``asyncio.run()`` the library tells sniffio once per call which library runs, instead of anyio
asking it on every call (:mod:`aioembed.session.async_library`), and leaves the caller's context as it was."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import sniffio
import trio

from aioembed import TransferConfig
from aioembed.session.async_library import KnownAsyncLibrary
from aioembed.session.tasks import BackgroundTasks

from .conftest import assert_same, make_request, running


class _CountedLookups:
    """Counts sniffio's own look-ups of asyncio (``asyncio.current_task``: anyio's asyncio backend holds its
    own reference, so only sniffio's calls go through the module attribute)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = asyncio.current_task

        def counted(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Task[Any] | None:
            self.calls += 1
            return real(loop)

        monkeypatch.setattr(asyncio, "current_task", counted)


def _under_asyncio_run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Plainly: not ``anyio.run()`` (which keeps the answer itself) nor the anyio pytest plugin."""
    asyncio.run(main())


def test_known_async_library_sets_only_inside_the_block() -> None:
    seen: list[str | None] = []

    async def main() -> None:
        seen.append(sniffio.current_async_library_cvar.get())
        with KnownAsyncLibrary():
            seen.append(sniffio.current_async_library_cvar.get())
            with KnownAsyncLibrary():  # nested: already known, left alone
                seen.append(sniffio.current_async_library_cvar.get())
            seen.append(sniffio.current_async_library_cvar.get())
        seen.append(sniffio.current_async_library_cvar.get())

    _under_asyncio_run(main)
    assert seen == [None, "asyncio", "asyncio", "asyncio", None]


def test_known_async_library_resets_when_the_block_raises() -> None:
    async def main() -> None:
        with pytest.raises(KeyError), KnownAsyncLibrary():
            assert sniffio.current_async_library_cvar.get() == "asyncio"
            raise KeyError("x")
        assert sniffio.current_async_library_cvar.get() is None

    _under_asyncio_run(main)


def test_known_async_library_leaves_trio_alone() -> None:
    async def main() -> None:
        before = (sniffio.current_async_library_cvar.get(), sniffio.thread_local.name)
        with KnownAsyncLibrary():
            assert (sniffio.current_async_library_cvar.get(), sniffio.thread_local.name) == before
            assert sniffio.current_async_library() == "trio"

    trio.run(main)


def test_background_tasks_know_the_library_and_the_spawner_is_unchanged() -> None:
    seen: list[str | None] = []

    async def main() -> None:
        tasks = BackgroundTasks("test", logging.getLogger("test"))
        await tasks.enter()
        done = asyncio.Event()

        async def job() -> None:
            seen.append(sniffio.current_async_library_cvar.get())
            done.set()

        assert tasks.spawn(job)
        await done.wait()
        seen.append(sniffio.current_async_library_cvar.get())
        await tasks.exit()

    _under_asyncio_run(main)
    assert seen == ["asyncio", None]


@pytest.mark.parametrize("mode", ["receive", "receive_leased"])
def test_a_room_under_asyncio_run_looks_the_library_up_once_per_call(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: 41 look-ups per 64-token room (both sides, loopback); now one per ``send()`` and one per receive."""
    rooms = 20
    result: dict[str, Any] = {}

    async def main() -> None:
        cfg = TransferConfig(default_tokens=256, pool_tokens=1024)
        async with running(cfg) as (sender, [receiver]):
            sources = [make_request(64, seed=i) for i in range(rooms + 1)]

            async def one(i: int) -> dict[str, Any]:
                room = f"{mode}-{i}"
                if mode == "receive":
                    got, _ = await asyncio.gather(receiver.receive(room, expected_tokens=64),
                                                  sender.send(room, sources[i]))
                    return dict(got.tensors)
                lease, _ = await asyncio.gather(receiver.receive_leased(room, expected_tokens=64),
                                                sender.send(room, sources[i]))
                rows = {name: t.clone() for name, t in lease.to_tensors().items()}
                lease.release()
                return rows

            assert_same(await one(rooms), sources[rooms])  # warm: connections, caches
            counter = _CountedLookups(monkeypatch)
            for i in range(rooms):
                assert_same(await one(i), sources[i])
            result["lookups"] = counter.calls
            result["after"] = sniffio.current_async_library_cvar.get()

    _under_asyncio_run(main)
    assert result["after"] is None  # the caller's context as it was
    assert result["lookups"] <= 2 * rooms, f"{result['lookups']} look-ups for {rooms} rooms"


def test_known_async_library_left_in_another_context_does_not_raise() -> None:
    """An async generator closed by the loop's shutdown hooks runs its cleanup in a task of its own: the block
    is left in another context than the one it was entered in. The reset is then refused, quietly: the context
    it was set in is the one ending, and the one it is left in is untouched."""
    seen: list[str | None] = []

    async def main() -> None:
        known = KnownAsyncLibrary()
        entered_in = contextvars.copy_context()
        entered_in.run(known.__enter__)
        assert entered_in.run(sniffio.current_async_library_cvar.get) == "asyncio"
        known.__exit__(None, None, None)  # here, not in entered_in
        seen.append(sniffio.current_async_library_cvar.get())

    _under_asyncio_run(main)
    assert seen == [None]


def test_a_background_task_that_raises_a_stray_cancel_is_logged_and_the_others_go_on(
        caplog: pytest.LogCaptureFixture) -> None:
    """A CancelledError nobody asked for (a future some other code cancelled) went out of the task and cancelled
    the owner's whole task group (a sender's control socket, liveness, timers) without a log line."""
    seen: list[str] = []

    async def main() -> None:
        tasks = BackgroundTasks("test", logging.getLogger("test"))
        await tasks.enter()
        others = asyncio.Event()

        async def stray() -> None:
            fut = asyncio.get_running_loop().create_future()
            fut.cancel()
            await fut  # raises CancelledError while this task is not being cancelled

        async def other() -> None:
            await asyncio.sleep(0.2)
            seen.append("other ran to its end")
            others.set()

        assert tasks.spawn(other) and tasks.spawn(stray)
        await asyncio.wait_for(others.wait(), 5)
        assert tasks.spawn(other)  # the owner still takes tasks
        others.clear()
        await asyncio.wait_for(others.wait(), 5)
        await tasks.exit()

    with caplog.at_level(logging.ERROR, logger="test"):
        _under_asyncio_run(main)
    assert seen == ["other ran to its end"] * 2
    assert any("stray" in r.getMessage() and "CancelledError nobody asked for" in r.getMessage()
               for r in caplog.records)


def test_background_tasks_still_end_when_cancelled() -> None:
    ended: list[str] = []

    async def main() -> None:
        tasks = BackgroundTasks("test", logging.getLogger("test"))
        await tasks.enter()
        started = asyncio.Event()

        async def forever() -> None:
            started.set()
            try:
                await asyncio.sleep(3600)
            finally:
                ended.append("cancelled")

        assert tasks.spawn(forever)
        await started.wait()
        tasks.cancel_all()
        await tasks.wait_done(5)
        await tasks.exit()

    _under_asyncio_run(main)
    assert ended == ["cancelled"]
