"""Zero-copy receive: rows stay in pool blocks under a lease until it is released."""

from __future__ import annotations

import contextlib
import time

import anyio
import pytest
import torch

from aioembed import InvalidRequest, Lease, TransferConfig, TransferError, TransferFailed

from .conftest import assert_pools_free, assert_same, make_request, running, wait_pools_free

pytestmark = pytest.mark.anyio


def _joined(lease: Lease) -> dict[str, torch.Tensor]:
    return {name: torch.cat(views) for name, views in lease.views.items()}


@pytest.mark.parametrize(("tokens", "rounds"), [(1, 1), (700, 1), (3000, 2), (4096, 2)])
async def test_lease_holds_the_rows_in_pool_blocks(tokens: int, rounds: int) -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(tokens, seed=tokens)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "z", src, {"k": 1})
            lease = await receiver.receive_leased("z")
        assert lease.num_tokens == tokens and lease.rounds == rounds and lease.metadata == {"k": 1}
        pool_ptrs = {t.data_ptr() for t in receiver.pool.tensors.values()}
        for name, views in lease.views.items():
            base = receiver.pool.tensors[name]
            for v in views:  # every view lies inside the pool tensor: nothing was copied
                assert base.data_ptr() <= v.data_ptr() < base.data_ptr() + base.numel() * base.element_size()
        assert pool_ptrs
        assert_same(_joined(lease), src)
        assert_same(lease.to_tensors(), src)
        used = receiver.allocator.stats.used
        assert used >= receiver.allocator.blocks_for(tokens)  # held until released
        async with lease:
            pass
        assert lease.released
        lease.release()  # idempotent
        assert_pools_free(sender, receiver)


async def test_request_larger_than_pool_cannot_be_leased() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=2048)
    async with running(cfg) as (sender, [receiver]):
        src = make_request(3000, seed=1)
        failures: list[BaseException] = []

        async def send() -> None:
            try:
                await sender.send("big", src)
            except Exception as exc:
                failures.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            with pytest.raises(TransferFailed, match="zero-copy"):
                await receiver.receive_leased("big")
        assert failures  # the sender was told
        # The receiver knew the room's length (TOTAL) while round 0 was still being written: the room failed then,
        # and its blocks stay fenced until the sender's ABORT_ACK, which may come after send() raised.
        await wait_pools_free(sender, receiver)


async def test_copying_and_leased_rooms_share_the_pool() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=8192)
    async with running(cfg) as (sender, [receiver]):
        a, b = make_request(2500, seed=2), make_request(2500, seed=3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "a", a)
            tg.start_soon(sender.send, "b", b)
            lease = await receiver.receive_leased("a")
            got = await receiver.receive("b")
        assert_same(got.tensors, b)
        with lease:
            assert_same(_joined(lease), a)
        assert_pools_free(sender, receiver)


async def test_receive_into_caller_buffers() -> None:
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096)
    async with running(cfg) as (sender, [receiver]):
        buffers = receiver.layout.empty(5000)
        src = make_request(3000, seed=9)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "o", src)
            got = await receiver.receive("o", out=buffers)
        assert_same(got.tensors, src)
        for name, t in got.tensors.items():
            assert t.data_ptr() == buffers[name].data_ptr()  # the caller's memory, no new allocation
        too_small = receiver.layout.empty(100)
        async with anyio.create_task_group() as tg:
            # the rows reach the pool (the sender succeeds); the receiver's copy-out is refused
            tg.start_soon(sender.send, "small", make_request(300, seed=10))
            with pytest.raises(TransferFailed, match="out= holds only"):
                await receiver.receive("small", out=too_small)
        with pytest.raises(InvalidRequest, match="fields"):
            receiver.start("bad", out={"embeddings": buffers["embeddings"]})
        assert_pools_free(sender, receiver)


async def test_two_large_zero_copy_rooms_one_is_admitted_the_other_fails_at_once() -> None:
    """Each needs 28 of the pool's 32 blocks: waiting for each other they would hold the pool until
    round_timeout. The first whose total is known is admitted; the other fails now, saying why."""
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, resume_reserve_tokens=0, round_timeout=10.0)
    async with running(cfg) as (sender, [receiver]):
        srcs = {room: make_request(3500, seed) for seed, room in enumerate(("a", "b"))}
        leases: dict[str, object] = {}
        errors: dict[str, BaseException] = {}

        async def recv(room: str) -> None:
            try:
                leases[room] = await receiver.receive_leased(room)
            except TransferFailed as exc:
                errors[room] = exc

        async def send(room: str) -> None:
            with contextlib.suppress(TransferError):
                await sender.send(room, srcs[room])

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for room in srcs:
                tg.start_soon(recv, room)
                tg.start_soon(send, room)
        assert time.monotonic() - t0 < 5.0  # not round_timeout
        assert len(leases) == 1 and len(errors) == 1, (leases, errors)
        (_failed, exc), = errors.items()
        assert "cannot be received zero-copy now" in str(exc) and "release leases" in str(exc)
        (ok, lease), = leases.items()
        assert isinstance(lease, Lease)
        async with lease:
            assert_same(lease.to_tensors(), srcs[ok])
        await wait_pools_free(sender, receiver)


@pytest.mark.parametrize("tokens", [1, 129, 1024, 1500])
async def test_a_lease_holds_only_the_blocks_of_its_rows(tokens: int) -> None:
    """The first reservation is default_tokens long (the request's length is not known yet); a lease held
    all of it, so eight leases of a few tokens took the whole pool, and a room the zero-copy admission let
    in (it counts the rows' blocks) waited until round_timeout for blocks the leases held."""
    cfg = TransferConfig(default_tokens=1024, pool_tokens=4096, resume_reserve_tokens=0, round_timeout=10.0)
    async with running(cfg) as (sender, [receiver]):
        small = make_request(tokens, 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "small", small)
            held = await receiver.receive_leased("small")
        assert receiver.allocator.stats.used == receiver.allocator.blocks_for(tokens)
        assert receiver.keeper.claimed_blocks == receiver.allocator.blocks_for(tokens)
        rest = 4096 - receiver.allocator.blocks_for(tokens) * cfg.block_size
        big = make_request(rest, 2)  # fits beside the held lease, to the block
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, "big", big)
                async with receiver.lease("big") as lease:
                    assert_same(lease.to_tensors(), big)
        async with held:
            assert_same(held.to_tensors(), small)
        await wait_pools_free(sender, receiver)
