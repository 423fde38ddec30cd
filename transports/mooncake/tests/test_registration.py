"""Registration accounting: repeated and overlapping regions on an engine that refuses overlaps."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from aioembed.errors import TransportError
from aioembed.transports.base import MemoryRegion, WriteOp

from aioembed_mooncake import MooncakeTransport
from aioembed_mooncake._regions import EngineRegistrations, Piece, PieceIndex

pytestmark = pytest.mark.anyio

TCP = {"protocol": "tcp", "hostname": "127.0.0.1"}


def R(a: int, n: int) -> MemoryRegion:
    return MemoryRegion(a, n)


def _check_invariants(reg: EngineRegistrations) -> None:
    pieces = reg.pieces
    for a, b in itertools.pairwise(pieces):
        assert a.end <= b.start, f"pieces overlap: {a} {b}"
    idx = reg.index()
    for r in reg.regions:
        assert not idx.gaps(r.address, r.end), f"{r} not backed by pieces {pieces}"
    assert reg.orphans() == [], "a piece outlived every region overlapping it"


def test_repeated_region_registers_once() -> None:
    reg = EngineRegistrations()
    assert reg.plan_add([R(1000, 100)]) == [Piece(1000, 1100)]
    reg.commit_add([R(1000, 100)], [Piece(1000, 1100)])
    assert reg.plan_add([R(1000, 100), R(1000, 100)]) == []
    reg.commit_add([R(1000, 100), R(1000, 100)], [])
    assert reg.remove([R(1000, 100)]) == []
    assert reg.remove([R(1000, 100)]) == []
    assert reg.remove([R(1000, 100)]) == [Piece(1000, 1100)]
    reg.forget([Piece(1000, 1100)])
    assert reg.pieces == [] and len(reg.regions) == 0


def test_overlap_registers_only_the_gaps() -> None:
    reg = EngineRegistrations()
    reg.commit_add([R(1000, 100)], reg.plan_add([R(1000, 100)]))
    # straddles both ends of the existing piece: only the two gaps are new
    new = reg.plan_add([R(900, 300)])
    assert new == [Piece(900, 1000), Piece(1100, 1200)]
    reg.commit_add([R(900, 300)], new)
    # a region inside, and one abutting: nothing / one new piece
    assert reg.plan_add([R(1050, 10)]) == []
    assert reg.plan_add([R(1200, 50)]) == [Piece(1200, 1250)]
    # overlapping regions in one call are merged before planning
    assert reg.plan_add([R(2000, 100), R(2050, 100)]) == [Piece(2000, 2150)]
    _check_invariants(reg)


def test_piece_stays_while_any_region_overlaps_it() -> None:
    reg = EngineRegistrations()
    whole, head = R(1000, 8192), R(1000, 4096)
    reg.commit_add([whole], reg.plan_add([whole]))
    reg.commit_add([head], reg.plan_add([head]))
    assert reg.remove([whole]) == []  # head still overlaps the piece
    assert reg.pieces == [Piece(1000, 9192)]
    assert reg.remove([head]) == [Piece(1000, 9192)]


def test_abutting_regions_of_one_call_are_given_back_one_by_one() -> None:
    """Two regions that only touch (two tensors the allocator placed end to end) registered in one call were
    merged into one engine piece, so unregistering (and freeing) one kept its memory registered with the engine
    for as long as the other lived: over RDMA, pinned pages of freed memory, which a later allocation at those
    addresses is not (only overlapping regions come from one allocation; abutting ones may not)."""
    reg = EngineRegistrations()
    first, second = R(1000, 100), R(1100, 100)
    new = reg.plan_add([first, second])
    assert new == [Piece(1000, 1100), Piece(1100, 1200)]
    reg.commit_add([first, second], new)
    assert reg.remove([first]) == [Piece(1000, 1100)]
    reg.forget([Piece(1000, 1100)])
    assert reg.pieces == [Piece(1100, 1200)]
    _check_invariants(reg)


def test_unknown_region_is_refused_and_changes_nothing() -> None:
    reg = EngineRegistrations()
    reg.commit_add([R(1000, 100)], reg.plan_add([R(1000, 100)]))
    with pytest.raises(TransportError):
        reg.remove([R(1000, 100), R(5000, 10)])
    assert len(reg.regions) == 1 and reg.pieces == [Piece(1000, 1100)]
    with pytest.raises(TransportError):
        reg.remove([R(1000, 100), R(1000, 100)])  # one registration, two removals
    assert len(reg.regions) == 1


def test_cut_points() -> None:
    idx = PieceIndex([Piece(100, 200), Piece(200, 300), Piece(400, 500)])
    assert idx.cut_points(150, 100) == [50]  # crosses 200
    assert idx.cut_points(100, 100) == []
    assert idx.cut_points(250, 200) == [50, 150]  # crosses 300 and 400
    assert idx.cut_points(100, 400) == [100, 200, 300]
    assert idx.cut_points(310, 50) == []  # between pieces
    assert idx.cut_points(120, 30) == []  # inside one piece


def test_cut_points_match_every_boundary_inside_the_span() -> None:
    rng = random.Random(7)
    for _ in range(300):
        pieces, pos = [], rng.randrange(0, 50)
        for _ in range(rng.randrange(0, 6)):
            start = pos + rng.choice([0, 0, rng.randrange(1, 40)])  # adjacent pieces and gaps
            pos = start + rng.randrange(1, 60)
            pieces.append(Piece(start, pos))
        idx = PieceIndex(pieces)
        bounds = {b for p in pieces for b in (p.start, p.end)}
        for _ in range(20):
            address, length = rng.randrange(0, pos + 20), rng.randrange(1, 120)
            want = sorted(b - address for b in bounds if address < b < address + length)
            assert idx.cut_points(address, length) == want, (pieces, address, length)


def test_random_register_unregister_sequences_keep_invariants() -> None:
    rng = random.Random(1)
    for _ in range(200):
        reg = EngineRegistrations()
        live: list[MemoryRegion] = []
        engine: set[Piece] = set()  # a model of the engine: refuses overlapping registrations
        for _ in range(40):
            if live and rng.random() < 0.45:
                r = live.pop(rng.randrange(len(live)))
                gone = reg.remove([r])
                for p in gone:
                    engine.remove(p)
                reg.forget(gone)
            else:
                batch = [R(rng.randrange(1, 60) * 16, rng.randrange(1, 20) * 16) for _ in range(rng.randrange(1, 3))]
                new = reg.plan_add(batch)
                for p in new:
                    assert all(p.end <= q.start or q.end <= p.start for q in engine), "engine would refuse (-7)"
                    engine.add(p)
                reg.commit_add(batch, new)
                live.extend(batch)
            _check_invariants(reg)
            assert set(reg.pieces) == engine
        gone = reg.remove(live)
        assert sorted(gone) == sorted(engine)


async def test_overlapping_registrations_on_a_real_engine() -> None:
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    src = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    base = buf.data_ptr()
    async with await MooncakeTransport.open(TCP) as a, await MooncakeTransport.open(TCP) as b:
        await a.register([MemoryRegion(src.data_ptr(), src.numel())])
        # pieces that abut and overlap, registered in several calls and repeated
        parts = [R(base + 4096, 8192), R(base, 4096 + 100), R(base + 8192, 16384), R(base + 4096, 8192),
                 R(base + 30000, 35536)]
        for p in parts:
            await b.register([p])
        await b.register(parts[:2])
        pieces = b.engine_pieces
        assert all(x.end <= y.start for x, y in itertools.pairwise(pieces))
        assert len(pieces) >= 3
        link = await a.connect(b.descriptor())
        # one op spanning several engine registrations (cut at their boundaries internally)
        await link.write([WriteOp(src.data_ptr(), base, 24576)])
        assert torch.equal(buf[:24576], src[:24576])
        for p in parts + parts[:2]:
            await b.unregister([p])
        assert b.engine_pieces == [] and len(b.regions) == 0
        with pytest.raises(TransportError):
            await b.unregister([parts[0]])
        # the peer refuses writes into memory it no longer has registered (the engine checks)
        await link.aclose()


async def test_register_refuses_cuda_memory_on_a_non_cuda_build() -> None:
    async with await MooncakeTransport.open(TCP) as a:
        if MooncakeTransport.capabilities.cuda:
            pytest.skip("CUDA build installed")
        with pytest.raises(TransportError, match="cuda"):
            await a.register([MemoryRegion(1 << 20, 4096, "cuda:0")])
