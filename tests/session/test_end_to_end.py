"""End to end on the loopback transport: every scenario of the seed documents, bit for bit."""

from __future__ import annotations

import math
import random
import sys

import anyio
import pytest
import torch

from aioembed import EmbeddingReceiver, Field, Layout, Received, TransferConfig, TransferStatus
from aioembed.memory.huge_pages import HUGE_PAGE_BYTES

from .conftest import assert_pools_free, assert_same, make_request, running

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("tokens", "default", "rounds"),
    [
        (1, 1024, 1),  # one token
        (128, 1024, 1),  # exactly one block
        (129, 1024, 1),  # a block plus one token
        (500, 1024, 1),  # fits the default reservation
        (2000, 1024, 2),  # one resume
        (1024, 1024, 1),  # exactly the default
        (1025, 1024, 2),  # one token over the default
    ],
)
async def test_sizes_and_rounds(tokens: int, default: int, rounds: int) -> None:
    cfg = TransferConfig(default_tokens=default, pool_tokens=8192)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(tokens, seed=tokens)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "room", src, {"tokens": tokens})
            got = await receiver.receive("room")
        assert got.num_tokens == tokens
        assert got.rounds == rounds
        assert got.metadata == {"tokens": tokens}
        assert_same(got.tensors, src)
        assert got.stats.bytes == tokens * receiver.layout.bytes_per_token
        assert_pools_free(sender, receiver)


async def test_many_rounds_with_pool_smaller_than_request() -> None:
    """50000 tokens, 8192 default, 16384-token pool shared with two other rooms: many rounds,
    and reservations have to wait for the other rooms' blocks."""
    cfg = TransferConfig(default_tokens=8192, pool_tokens=16384, max_round_tokens=8192)
    async with running(cfg) as (sender, [receiver]):
        big = make_request(50000, seed=1)
        other = make_request(30000, seed=2)
        third = make_request(20000, seed=3)
        results = {}

        async def recv(room: str) -> None:
            results[room] = await receiver.receive(room)

        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "big", big)
            tg.start_soon(sender.send, "other", other)
            tg.start_soon(sender.send, "third", third)
            tg.start_soon(recv, "big")
            tg.start_soon(recv, "other")
            tg.start_soon(recv, "third")
        # rounds shrink to what is free while the pool is shared: the count is a lower bound
        assert results["big"].rounds >= math.ceil(50000 / 8192)
        assert results["other"].rounds >= math.ceil(30000 / 8192)
        assert_same(results["big"].tensors, big)
        assert_same(results["other"].tensors, other)
        assert_same(results["third"].tensors, third)
        stats = receiver.allocator.stats
        assert stats.high_water == stats.total  # the pool was full at some point
        assert stats.waited > 0  # and a reservation had to wait for free blocks
        assert_pools_free(sender, receiver)


async def test_expected_tokens_gives_one_round() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=32768)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(20000, seed=3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, 7, src)
            got = await receiver.receive(7, expected_tokens=20000)
        assert got.rounds == 1
        assert_same(got.tensors, src)
        assert_pools_free(sender, receiver)


async def test_expected_tokens_too_small_still_resumes() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=8192)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(3000, seed=4)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, 8, src)
            got = await receiver.receive(8, expected_tokens=1000)
        assert got.rounds == 2
        assert_same(got.tensors, src)


async def test_four_ranks_each_receive_full_rows() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)
    async with running(cfg, world=4) as (sender, receivers):
        src = make_request(5000, seed=5)
        got = {}

        async def recv(i: int) -> None:
            got[i] = await receivers[i].receive("multi")

        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(recv, i)
            await sender.send("multi", src, {"ranks": 4})
            # send() returned: every rank must already hold every token
            assert len(sender._rooms) == 0
        for i in range(4):
            assert_same(got[i].tensors, src)
            assert got[i].metadata == {"ranks": 4}
            assert got[i].rounds == math.ceil(5000 / 4096)
        assert_pools_free(sender, *receivers)


async def test_ranks_resume_independently() -> None:
    """Ranks with different reservations progress independently (no cross-rank agreement)."""
    cfg = TransferConfig(default_tokens=1024, pool_tokens=8192)
    async with running(cfg, world=2) as (sender, receivers):
        src = make_request(6000, seed=6)
        got = {}

        async def recv(i: int, expected: int | None) -> None:
            got[i] = await receivers[i].receive("indep", expected_tokens=expected)

        async with anyio.create_task_group() as tg:
            tg.start_soon(recv, 0, None)  # 1024 first, then the rest: 2 rounds
            tg.start_soon(recv, 1, 6000)  # all at once: 1 round
            tg.start_soon(sender.send, "indep", src)
        assert got[0].rounds == 2 and got[1].rounds == 1
        assert_same(got[0].tensors, src)
        assert_same(got[1].tensors, src)
        assert_pools_free(sender, *receivers)


async def test_hundred_concurrent_rooms_of_mixed_sizes() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=16384)
    rng = random.Random(7)
    sizes = [rng.choice([1, 17, 128, 129, 500, 1024, 1500, 3000, 7000]) for _ in range(100)]
    async with running(cfg) as (sender, [receiver]):
        srcs = {room: make_request(n, seed=room) for room, n in enumerate(sizes)}
        got = {}

        async def recv(room: int) -> None:
            got[room] = await receiver.receive(room)

        async with anyio.create_task_group() as tg:
            order = list(srcs)
            rng.shuffle(order)
            for room in order:
                tg.start_soon(recv, room)
                tg.start_soon(sender.send, room, srcs[room], {"room": room})
        for room, src in srcs.items():
            assert_same(got[room].tensors, src)
            assert got[room].metadata == {"room": room}
        assert_pools_free(sender, receiver)


@pytest.mark.parametrize("first", ["receiver", "sender"])
async def test_either_side_may_start_first(first: str) -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=8192)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(2500, seed=8)
        async with anyio.create_task_group() as tg:
            if first == "receiver":
                handle = receiver.start("r")
                with anyio.fail_after(5):
                    while handle.status is not TransferStatus.WAITING_FOR_INPUT:
                        await anyio.sleep(0.005)
                with anyio.fail_after(5):
                    while sender.rooms_in_flight == 0:  # the INIT reached the sender
                        await anyio.sleep(0.005)
                await anyio.sleep(0.05)
                await sender.send("r", src)
                got = await handle.result()
            else:
                tg.start_soon(sender.send, "r", src)
                with anyio.fail_after(5):
                    while sender.rooms_in_flight == 0:
                        await anyio.sleep(0.005)
                await anyio.sleep(0.05)
                got = await receiver.receive("r")
        if first == "receiver":
            assert handle.status is TransferStatus.SUCCESS
        assert_same(got.tensors, src)
        assert_pools_free(sender, receiver)


async def test_metadata_round_trip() -> None:
    meta = {"request_id": "req-1", "image_sizes": [[448, 448], [224, 336]], "mm_hashes": [b"\x00\x01", b"z"],
            "nested": {"a": 1.5, "b": None, "c": True}}
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(300, seed=9)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "meta", src, meta)
            got = await receiver.receive("meta")
        assert got.metadata == meta
        assert_same(got.tensors, src)


async def test_handle_status_and_wait() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(2000, seed=10)
        handle = receiver.start("h")
        assert handle.status in (TransferStatus.BOOTSTRAPPING, TransferStatus.WAITING_FOR_INPUT)
        assert not handle.done
        await sender.send("h", src)
        assert await handle.wait() is TransferStatus.SUCCESS
        assert handle.done
        got = await handle.result()
        assert got.rounds == 2
        assert_same(got.tensors, src)
        assert set(got.stats.phases) >= {"handshake", "allocate", "wait", "copy"}


async def test_a_large_copied_receive_lands_bit_for_bit_in_a_huge_page_output() -> None:
    """8 KiB rows: the embeddings of 3000 tokens (24 MB) go to a fresh output on huge pages, copied
    chunk by chunk over two rounds."""
    wide = Layout(embeddings=Field((4096,), torch.bfloat16), token_ids=Field((), torch.int32))
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, copy_chunk_tokens=512)
    async with running(cfg, layout=wide) as (sender, [receiver]):
        src = make_request(3000, seed=11, layout=wide)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "wide", src)
            got = await receiver.receive("wide")
        assert got.rounds == 2
        assert_same(got.tensors, src)
        if sys.platform == "linux":
            assert got.tensors["embeddings"].data_ptr() % HUGE_PAGE_BYTES == 0
        assert_pools_free(sender, receiver)


async def _lent_once_copy_threads_let_go(receiver: EmbeddingReceiver, want: int) -> int:
    """``outputs.stats.lent`` once it is ``want`` (bounded): an anyio worker thread reports a copy's end to the loop
    before it drops its reference to the job, and so to the output it copied into (CI caught the race once)."""
    with anyio.move_on_after(2.0):
        while receiver.outputs.stats.lent != want:
            await anyio.sleep(0.001)
    return receiver.outputs.stats.lent


async def test_fresh_outputs_reuse_the_memory_of_dropped_ones_never_of_held_ones() -> None:
    """``receive()``'s large fields come from the receiver's output cache: a dropped result's memory
    makes the next output (no page faults), while a result still held keeps its rows."""
    wide = Layout(embeddings=Field((4096,), torch.bfloat16), token_ids=Field((), torch.int32))
    cfg = TransferConfig(default_tokens=2048, pool_tokens=4096, copy_chunk_tokens=512)

    async with running(cfg, layout=wide) as (sender, [receiver]):

        async def one(room: str, src: dict[str, torch.Tensor]) -> Received:
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, room, src)
                return await receiver.receive(room)

        first_src, second_src, third_src = (make_request(1500, seed=s, layout=wide) for s in (1, 2, 3))
        first = await one("a", first_src)
        assert_same(first.tensors, first_src)
        ptr = first.tensors["embeddings"].data_ptr()
        held = await one("b", second_src)  # first is held: its rows stay
        assert held.tensors["embeddings"].data_ptr() != ptr
        assert_same(first.tensors, first_src)
        assert_same(held.tensors, second_src)
        del first
        third = await one("c", third_src)
        assert third.tensors["embeddings"].data_ptr() == ptr
        assert_same(third.tensors, third_src)
        assert_same(held.tensors, second_src)
        stats = receiver.outputs.stats
        assert (stats.hits, stats.misses, stats.lent) == (1, 2, 2)
        del third, held
        assert await _lent_once_copy_threads_let_go(receiver, 0) == 0
        assert_pools_free(sender, receiver)
    assert receiver.outputs.stats.idle_bytes == 0  # closing the receiver freed them


async def test_outputs_held_among_many_concurrent_receives_keep_their_rows() -> None:
    """Rooms four at a time, each result kept or dropped at random: the dropped ones' memory makes
    later outputs while every kept result still holds its own rows, bit for bit, at the end."""
    wide = Layout(embeddings=Field((4096,), torch.bfloat16), token_ids=Field((), torch.int32))
    cfg = TransferConfig(default_tokens=2048, pool_tokens=8192, copy_chunk_tokens=512)
    rng = random.Random(7)
    sizes = [rng.choice((1024, 1100, 1500, 2000)) for _ in range(16)]
    keep = [rng.random() < 0.5 for _ in sizes]
    kept: dict[int, Received] = {}
    async with running(cfg, layout=wide) as (sender, [receiver]):
        limit = anyio.Semaphore(4)

        async def one(i: int) -> None:
            async with limit:
                src = make_request(sizes[i], seed=100 + i, layout=wide)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender.send, f"r{i}", src)
                    got = await receiver.receive(f"r{i}")
                assert_same(got.tensors, src)
                if keep[i]:
                    kept[i] = got
                del got, src

        async with anyio.create_task_group() as tg:
            for i in range(len(sizes)):
                tg.start_soon(one, i)
        for i, got in kept.items():
            assert_same(got.tensors, make_request(sizes[i], seed=100 + i, layout=wide))
        assert receiver.outputs.stats.hits > 0
        assert await _lent_once_copy_threads_let_go(receiver, len(kept)) == len(kept)
        assert_pools_free(sender, receiver)
