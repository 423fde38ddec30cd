"""The receiving child's commands (``aioembed.bench.peer``), driven in this process over loopback: what it
answers, when it checks a room's rows and that it lets every held room go.

The plugins' tests run the child for real across processes (``aioembed.testing.bench.check_rows_after_the_clock``);
these run without any plugin installed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from aioembed.bench import peer
from aioembed.bench.workloads import ROOM_OFFSETS, make_source, room_rows
from aioembed.config import TransferConfig
from aioembed.samples import standard_layout
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender

N = 256
SEED = 7
GOOD = [SEED, N + ROOM_OFFSETS]
BAD = [SEED + 1, N + ROOM_OFFSETS]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the child runs under asyncio (its commands are asyncio tasks)


class Child:
    """The child's state (as its ``_run`` keeps it) beside an in-process sender, and the answers it emitted."""

    def __init__(self, sender: EmbeddingSender, receiver: EmbeddingReceiver) -> None:
        self.sender = sender
        self.receiver = receiver
        self.checker = peer._Checker(receiver.layout)
        self.held: dict[int, Any] = {}
        self.tasks: set[Any] = set()
        self.answers: dict[int, dict[str, Any]] = {}
        self._arrived = anyio.Event()
        self.src = make_source(receiver.layout, N + ROOM_OFFSETS, seed=SEED)

    def emit(self, **event: Any) -> None:
        self.answers[event["id"]] = event
        self._arrived.set()

    def command(self, cmd: dict[str, Any]) -> None:
        peer._dispatch(dict(cmd, sender=self.sender.address), self.receiver, self.checker, self.held, self.tasks)

    async def answer(self, cid: int) -> dict[str, Any]:
        with anyio.fail_after(10):
            while cid not in self.answers:
                self._arrived = anyio.Event()
                await self._arrived.wait()
        return self.answers.pop(cid)

    async def send(self, room: str) -> None:
        await self.sender.send(room, room_rows(self.src, room, N))


@pytest.fixture
async def child(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Child]:
    layout = standard_layout(64)
    # A pool of exactly one room: a lease the child kept would stop the next lease at once.
    cfg = TransferConfig(transport="loopback", block_size=128, default_tokens=N, pool_tokens=N,
                         resume_reserve_tokens=0, round_timeout=5.0)
    async with EmbeddingSender(layout, cfg) as sender, \
            EmbeddingReceiver(layout, cfg, connect=sender.address) as receiver:
        await receiver.wait_connected()
        c = Child(sender, receiver)
        monkeypatch.setattr(peer, "_emit", c.emit)
        yield c
        for task in c.tasks:
            task.cancel()


def recv(cid: int, room: str, mode: str, check: list[int], *, hold: bool) -> dict[str, Any]:
    return {"op": "recv", "id": cid, "room": room, "expected": N, "mode": mode, "check": check, "out_tokens": N,
            "hold": hold}


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["lease", "copy", "out"])
async def test_a_held_room_is_answered_without_a_verdict_then_checked_on_the_parents_word(
        child: Child, mode: str) -> None:
    child.command(recv(1, "a", mode, GOOD, hold=True))
    await child.send("a")
    done = await child.answer(1)
    assert "error" not in done and done["rounds"] == 1 and done["t"] >= done["t0"] and "checked" not in done
    assert 1 in child.held
    child.command({"op": "check", "id": 2, "of": 1})
    assert await child.answer(2) == {"event": "done", "id": 2, "checked": True}
    assert child.held == {}
    child.command(recv(3, "b", mode, BAD, hold=True))
    await child.send("b")
    assert "error" not in await child.answer(3)
    child.command({"op": "check", "id": 4, "of": 3})
    assert "room 'b': the rows differ from the source" in (await child.answer(4))["error"]
    child.command(recv(5, "c", "lease", GOOD, hold=False))  # the bad lease was released: the pool is free
    await child.send("c")
    assert "error" not in await child.answer(5)


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["lease", "copy"])
async def test_a_batch_room_is_checked_before_the_child_answers(child: Child, mode: str) -> None:
    child.command(recv(1, "a", mode, GOOD, hold=False))
    await child.send("a")
    assert "error" not in await child.answer(1) and child.held == {}
    child.command(recv(2, "b", mode, BAD, hold=False))
    await child.send("b")
    assert "room 'b': the rows differ from the source" in (await child.answer(2))["error"]
    child.command(recv(3, "c", "lease", GOOD, hold=False))  # a bad lease is released all the same
    await child.send("c")
    assert "error" not in await child.answer(3)


@pytest.mark.anyio
async def test_a_check_read_before_its_room_started_still_lets_the_lease_go(child: Child) -> None:
    """The parent lets go of a room whose ``send()`` failed by sending ``check`` right behind the ``recv``: both
    lines can be read before the room's task first runs. The check must still find the room, or a lease that then
    lands is held for good."""
    child.command(recv(1, "a", "lease", GOOD, hold=True))
    child.command({"op": "check", "id": 2, "of": 1})
    await child.send("a")  # the room lands after all
    assert "error" not in await child.answer(1)
    assert await child.answer(2) == {"event": "done", "id": 2, "checked": True}
    child.command(recv(3, "b", "lease", GOOD, hold=False))
    await child.send("b")
    assert "error" not in await child.answer(3)


@pytest.mark.anyio
@pytest.mark.parametrize("chunk_tokens", [64, 0])
async def test_a_streamed_rooms_chunks_are_checked_in_token_order(child: Child, chunk_tokens: int) -> None:
    def stream(cid: int, room: str, check: list[int]) -> dict[str, Any]:
        return {"op": "stream", "id": cid, "room": room, "expected": None, "chunk_tokens": chunk_tokens,
                "check": check, "out_tokens": N, "hold": True}

    child.command(stream(1, "a", GOOD))
    await child.send("a")
    done = await child.answer(1)
    assert done["chunks"] >= (2 if chunk_tokens else 1)  # chunks of whole blocks at least (128 tokens here)
    assert done["t0"] <= done["t_first"] <= done["t"]
    child.command({"op": "check", "id": 2, "of": 1})
    assert await child.answer(2) == {"event": "done", "id": 2, "checked": True}
    child.command(stream(3, "b", BAD))
    await child.send("b")
    await child.answer(3)
    child.command({"op": "check", "id": 4, "of": 3})
    assert "room 'b': the streamed rows differ from the source" in (await child.answer(4))["error"]


def test_chunks_out_of_token_order_are_refused() -> None:
    import torch

    from aioembed.bench.workloads import chunk_rows
    from aioembed.session.stream import Chunk

    def chunk(start: int, end: int) -> Chunk:
        return Chunk(room="r", start=start, end=end, total=8, tensors={"x": torch.zeros(end - start)}, metadata={})

    assert [t.shape[0] for t in chunk_rows([chunk(0, 3), chunk(3, 8)])["x"]] == [3, 5]
    with pytest.raises(ValueError, match="a chunk starts at token 5, expected 3"):
        chunk_rows([chunk(0, 3), chunk(5, 8)])
    with pytest.raises(ValueError, match="a chunk starts at token 3, expected 0"):
        chunk_rows([chunk(3, 8), chunk(0, 3)])
