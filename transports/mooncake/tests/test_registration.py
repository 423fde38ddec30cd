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


async def test_a_failed_registration_batch_leaves_nothing_registered() -> None:
    """The engine checks a whole batch before it registers any span of it (and unregisters them all if its
    transport fails one), so ``register()`` records nothing when the batch fails: this pins that (0.3.13.post1)."""
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    base = buf.data_ptr()
    good, taken = R(base, 4096), R(base + 8192, 4096)
    async with await MooncakeTransport.open(TCP) as a, await MooncakeTransport.open(TCP) as b:
        engine = b._engine
        # the engine's answers for batches with one bad span: nothing of the batch stays registered
        for starts, lengths in (([base, base + 8192], [4096, 0]),  # zero length
                                ([base, base + 100], [4096, 100])):  # overlap within the batch
            assert engine.batch_register_memory(starts, lengths) != 0
            assert engine.batch_register_memory([base], [4096]) == 0  # not left registered
            assert engine.batch_unregister_memory([base]) == 0
        # through the plugin: a span the engine holds already (registered behind the plugin's back) fails the batch
        assert engine.register_memory(taken.address, taken.length) == 0
        with pytest.raises(TransportError, match="batch_register_memory returned -7"):
            await b.register([good, taken])
        assert b.engine_pieces == [] and len(b.regions) == 0
        assert engine.unregister_memory(taken.address) == 0
        await b.register([good])  # the engine registers it again (refused as overlapping had it been left)
        assert b.engine_pieces == [Piece(good.address, good.end)]
        await a.register([MemoryRegion.of_tensor(src)])
        link = await a.connect(b.descriptor())
        await link.write([WriteOp(src.data_ptr(), good.address, 4096)])
        assert torch.equal(buf[:4096], src)
        await link.aclose()


async def test_the_engines_batch_unregistration_is_not_all_or_nothing() -> None:
    """What ``unregister()`` is built on (0.3.13.post1): a batch with an address the engine does not hold fails
    (-3), yet the engine let go of the other spans (each answers -3 from then on), and it keeps them all in its
    own table (registering them again is refused as overlapping, -7)."""
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    base = buf.data_ptr()
    async with await MooncakeTransport.open(TCP) as b:
        engine = b._engine
        assert engine.batch_register_memory([base, base + 8192], [4096, 4096]) == 0
        assert engine.batch_unregister_memory([base, base + 20000, base + 8192]) == -3
        assert engine.batch_unregister_memory([base]) == -3
        assert engine.batch_unregister_memory([base + 8192]) == -3
        assert engine.batch_register_memory([base], [4096]) == -7


async def test_a_span_the_engine_let_go_of_does_not_fail_later_unregistrations() -> None:
    """The engine's batch unregistration goes on past a span it cannot unregister, and such a span answers -3
    (not registered) from then on. The plugin kept the spans of a failed batch and retried them in the next
    batch: that batch failed with -3, so every later ``unregister()`` failed, and the engine kept the other spans
    of each such batch in its table for good (registering them again was refused as overlapping)."""
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    src = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    base = buf.data_ptr()
    x, y = R(base, 4096), R(base + 8192, 4096)
    async with await MooncakeTransport.open(TCP) as a, await MooncakeTransport.open(TCP) as b:
        await b.register([x])
        await b.register([y])
        assert b._engine.unregister_memory(x.address) == 0  # the engine no longer holds x
        await b.unregister([x])  # the engine answers -3 for it: it is not registered, as asked
        await b.unregister([y])
        assert b.engine_pieces == [] and len(b.regions) == 0
        await b.register([y])  # the engine let go of y entirely: it registers it again
        await a.register([MemoryRegion.of_tensor(src)])
        link = await a.connect(b.descriptor())
        await link.write([WriteOp(src.data_ptr(), y.address, 4096)])
        assert torch.equal(buf[8192:12288], src)
        await link.aclose()


class _RefusingEngine:
    """The engine, except that its batch unregistration refuses the addresses in ``refuse`` (-1), as the engine
    does: going on with the others of the batch."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.refuse: set[int] = set()
        self.batches: list[list[int]] = []

    def batch_unregister_memory(self, starts: list[int]) -> int:
        self.batches.append(list(starts))
        rest = [s for s in starts if s not in self.refuse]
        rc = self.engine.batch_unregister_memory(rest) if rest else 0  # type: ignore[attr-defined]
        return -1 if len(rest) < len(starts) else int(rc)

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


async def test_a_span_the_engine_refuses_to_unregister_is_retried_alone() -> None:
    """A span the engine refused to unregister stays recorded and is retried on the next unregistration, on its
    own: the unregistrations of other regions meanwhile succeed (they failed with it before)."""
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    base = buf.data_ptr()
    x, y, z = R(base, 4096), R(base + 8192, 4096), R(base + 16384, 4096)
    async with await MooncakeTransport.open(TCP) as b:
        real = b._engine
        proxy = _RefusingEngine(real)
        b._engine = proxy
        try:
            await b.register([x, y, z])
            proxy.refuse.add(x.address)
            with pytest.raises(TransportError) as refused:
                await b.unregister([x])
            assert b.engine_pieces == [Piece(x.address, x.end), Piece(y.address, y.end), Piece(z.address, z.end)]
            await b.unregister([y])  # x, refused again, is retried apart from y (and only logged: reported before)
            assert b.engine_pieces == [Piece(x.address, x.end), Piece(z.address, z.end)]
            assert [y.address] in proxy.batches and not any(x.address in s and len(s) > 1 for s in proxy.batches)
            assert f"4096 bytes at {x.address:#x} (-1)" in str(refused.value)  # which span, the engine's answer
            proxy.refuse.clear()
            await b.unregister([z])  # x goes with it now
            assert b.engine_pieces == [] and len(b.regions) == 0
            assert real.batch_register_memory([x.address, y.address, z.address], [4096] * 3) == 0  # none held
            assert real.batch_unregister_memory([x.address, y.address, z.address]) == 0
        finally:
            b._engine = real
