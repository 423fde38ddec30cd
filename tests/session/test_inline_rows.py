"""A round's small fields ride inside its STATUS (``status_inline_bytes``): the rows arrive bit for bit, the transport
writes only the rest, the receiver checks what it takes, and nothing changes where it cannot apply (a receiver
that takes none, rounds announced chunk by chunk)."""

from __future__ import annotations

import dataclasses

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aioembed import EmbeddingReceiver, EmbeddingSender, Part, TransferConfig, TransferError
from aioembed.errors import PlanError, ProtocolError
from aioembed.memory.plan import plan_inline
from aioembed.memory.pool import BlockPool
from aioembed.protocol.messages import (
    MAX_FRAME_BYTES,
    MAX_INLINE_BYTES,
    MAX_METADATA_BYTES,
    Hello,
    Status,
    check_metadata,
    decode,
    encode,
)
from aioembed.protocol.room import ReceiverRoomState
from aioembed.samples import same_rows
from aioembed.session.send_room import SendRoomDriver
from aioembed.testing import MockTransport, WriteCall

from .conftest import LAYOUT, CountingTransport, make_request, wait_pools_free

pytestmark = pytest.mark.anyio

CFG = TransferConfig(default_tokens=1024, pool_tokens=8192, block_size=16, handshake_timeout=2.0,
                     input_timeout=5.0, round_timeout=2.0, room_timeout=10.0)
EMB, IDS, MROPE = (f.row_bytes for f in LAYOUT.values())


# -- planning (pure) ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sizes", "limit", "want"), [
    ([8192, 256, 1536], 8192, (1, 2)),       # the small fields, not the largest
    ([8192, 256, 1536], 1792, (1, 2)),       # exactly at the limit
    ([8192, 256, 1536], 1791, (1,)),         # smallest first while they fit
    ([8192, 256, 1536], 255, ()),
    ([8192, 256, 1536], 0, ()),              # the receiver takes none
    ([100, 100], 1 << 20, (1,)),             # equals: the first stays on the transport
    ([64], 1 << 20, ()),                     # one field: always written
    ([None, 256, 1536], 8192, (1, 2)),       # a field not on the CPU is written: the round keeps that write
    ([256, None, 8192, 24], 8192, (0, 3)),   # smallest first: 8192 no longer fits
    ([256, None, 8192, 24], 8471, (0, 3)),
    ([256, None, 8192, 24], 8472, (0, 2, 3)),
    ([None, None], 8192, ()),
])
def test_plan_inline(sizes: list[int | None], limit: int, want: tuple[int, ...]) -> None:
    assert plan_inline(sizes, limit) == want


# -- the codec and the room machine ------------------------------------------------------------------


def _status(**kw: object) -> Status:
    base: dict[str, object] = dict(room="r", state="SUCCESS", total_tokens=4, sent_tokens=4, round=0)
    return Status(**{**base, **kw})  # type: ignore[arg-type]


def test_status_inline_round_trips() -> None:
    msg = _status(inline=((1, b"\x00\x01" * 8), (2, b"\xff" * 96)))
    assert decode(encode(msg)) == msg
    assert decode(encode(_status())).inline == ()  # type: ignore[union-attr]


@pytest.mark.parametrize("inline", [
    ((2, b"a"), (1, b"b")),                  # not in field order
    ((1, b"a"), (1, b"b")),                  # twice
    ((True, b"a"),),
    ((256, b"a"),),
    ((-1, b"a"),),
    ((1, "text"),),
    ((1,),),
    ((0, b"\x00" * (MAX_INLINE_BYTES // 2 + 1)), (1, b"\x00" * (MAX_INLINE_BYTES // 2))),  # too many bytes
])
def test_bad_inline_is_refused_by_the_codec(inline: object) -> None:
    with pytest.raises(ProtocolError, match="inline"):
        encode(_status(inline=inline))


def test_hello_status_inline_bytes_range() -> None:
    hello = Hello(receiver_id="x", epoch=1, fingerprint="f", transport="loopback", descriptor=b"", block_size=16,
                  num_blocks=4, rank=0, world=1, regions=((1, 64),), status_inline_bytes=MAX_INLINE_BYTES)
    assert decode(encode(hello)) == hello
    with pytest.raises(ProtocolError, match="status_inline_bytes"):
        encode(dataclasses.replace(hello, status_inline_bytes=-1))


def test_a_failed_status_carries_no_rows() -> None:
    m = ReceiverRoomState("r", block_size=16, max_tokens=1000)
    m.init_sent(blocks=1, allocated_tokens=16)
    with pytest.raises(ProtocolError, match="inline"):
        m.on_status(_status(state="FAILED", total_tokens=0, sent_tokens=0, inline=((1, b"x"),)))
    assert m.state.name == "WAITING_FOR_INPUT"  # unchanged: the caller fails the room


def test_pool_write_rows_fills_scattered_blocks() -> None:
    pool = BlockPool(LAYOUT, num_blocks=8, block_size=4)
    rows = make_request(10, seed=3)
    ids, pos = rows["token_ids"].numpy().tobytes(), rows["mrope_positions"].numpy().tobytes()
    pool.write_rows([6, 1, 2], [(1, ids), (2, pos)], 10)  # blocks 1 and 2 adjacent, 6 apart
    for name in ("token_ids", "mrope_positions"):
        t = pool.tensors[name]
        assert torch.equal(t[24:28], rows[name][0:4]) and torch.equal(t[4:10], rows[name][4:10])
    assert not pool.tensors["embeddings"].any()
    before = {k: v.clone() for k, v in pool.tensors.items()}
    # Every entry is checked before any is written.
    for bad, why in [([(1, ids), (2, pos[:-1])], "expected 10 rows"), ([(1, ids), (3, b"")], "field number 3")]:
        with pytest.raises(PlanError, match=why):
            pool.write_rows([0, 3, 5], bad, 10)
        assert all(torch.equal(before[k], pool.tensors[k]) for k in before)


# -- end to end -----------------------------------------------------------------------------------------


def _recording() -> tuple[CountingTransport, list[WriteCall]]:
    calls: list[WriteCall] = []
    return CountingTransport(faults=lambda call: calls.append(call) or None), calls  # type: ignore[func-returns-value]


def _written(calls: list[WriteCall]) -> int:
    return sum(op.length for call in calls for op in call.ops)


async def test_small_fields_ride_in_the_status_bit_for_bit() -> None:
    writer, calls = _recording()
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        # 64 tokens: ids (256 B) and positions (1536 B) inline, one write of the embeddings.
        # 300 tokens: positions (7200 B) and ids (1200 B) exceed 8192 together: only the ids.
        # 3000 tokens in rounds of 1024: the ids (4096 B) of each round inline.
        for i, (n, inline_per_token) in enumerate([(64, IDS + MROPE), (300, IDS), (3000, IDS), (1, IDS + MROPE)]):
            want = make_request(n, seed=i)
            calls.clear()
            for mode in ("receive", "leased", "out"):
                calls.clear()
                room = f"r{i}-{mode}"
                async with anyio.create_task_group() as tg:
                    tg.start_soon(sender.send, room, want)
                    if mode == "receive":
                        got = dict((await receiver.receive(room)).tensors)
                    elif mode == "out":
                        out = LAYOUT.empty(n)
                        await receiver.receive(room, out=out)
                        got = out
                    else:
                        with await receiver.receive_leased(room) as lease:
                            got = lease.to_tensors()
                assert same_rows(got, want), f"{room}: the rows differ"
                assert _written(calls) == n * (LAYOUT.bytes_per_token - inline_per_token), room
        await wait_pools_free(sender, receiver)


async def test_a_receiver_taking_none_gets_every_row_written() -> None:
    writer, calls = _recording()
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG.replace(status_inline_bytes=0), connect=sender.address,
                              transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        want = make_request(64, seed=7)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "r", want)
            got = await receiver.receive("r")
        assert same_rows(dict(got.tensors), want)
        assert _written(calls) == 64 * LAYOUT.bytes_per_token
        assert len([op for call in calls for op in call.ops]) == len(LAYOUT)


async def test_rounds_announced_in_chunks_write_every_field() -> None:
    """A streamed round is announced chunk by chunk (PROGRESS): its rows are all written, none inline."""
    writer, calls = _recording()
    cfg = CFG.replace(stream_chunk_tokens=64)
    async with EmbeddingSender(LAYOUT, cfg, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        want = make_request(200, seed=8)
        chunks: list[dict[str, torch.Tensor]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "s", want)
            async with receiver.stream("s") as stream:
                async for chunk in stream:
                    chunks.append({k: v.clone() for k, v in chunk.tensors.items()})
        got = {k: torch.cat([c[k] for c in chunks]) for k in want}
        assert same_rows(got, want)
        assert _written(calls) == 200 * LAYOUT.bytes_per_token
        # ... while a short one (a single chunk: no PROGRESS) still carries its small fields inline.
        calls.clear()
        small = make_request(40, seed=9)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "t", small)
            async with receiver.stream("t") as stream:
                parts = [{k: v.clone() for k, v in c.tensors.items()} async for c in stream]
        got = {k: torch.cat([p[k] for p in parts]) for k in small}
        assert same_rows(got, small)
        assert _written(calls) == 40 * EMB


async def test_several_ranks_each_get_the_small_fields_inline() -> None:
    writer, calls = _recording()
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, rank=0, world=2,
                              transport=MockTransport()) as r0, \
            EmbeddingReceiver(LAYOUT, CFG, connect=sender.address, rank=1, world=2,
                              transport=MockTransport()) as r1:
        await r0.wait_connected()
        await r1.wait_connected()
        want = make_request(64, seed=11)
        results = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "m", want)

            async def take(r: EmbeddingReceiver) -> None:
                results[r.rank] = dict((await r.receive("m")).tensors)

            tg.start_soon(take, r0)
            tg.start_soon(take, r1)
        assert all(same_rows(results[k], want) for k in (0, 1))
        assert _written(calls) == 2 * 64 * EMB
        await wait_pools_free(sender, r0, r1)


@pytest.mark.parametrize(("bad", "why"), [
    ("short", "expected 64 rows of"),
    ("field", "field number 7: the layout has 3 fields"),
    ("limit", "takes at most 0"),
    ("progress", "after a PROGRESS"),
])
async def test_the_receiver_refuses_rows_it_cannot_take(monkeypatch: pytest.MonkeyPatch, bad: str,
                                                        why: str) -> None:
    """A STATUS whose inline rows are short, of a field the layout lacks, more than the receiver takes, or in a
    round announced by PROGRESS fails the room at the receiver, and none of its rows is copied. (The sender's
    send() has returned by then: the round was its last, and its STATUS went out.)"""
    real_rows = SendRoomDriver._inline_rows

    def rows(self: SendRoomDriver, task: object, fields: tuple[int, ...]) -> tuple[tuple[int, bytes], ...]:
        good = real_rows(self, task, fields)  # type: ignore[arg-type]
        if bad == "short":
            return ((good[0][0], good[0][1][:-4]), *good[1:])
        if bad == "field":
            return (*good, (7, b"\x00" * 64))
        return good

    monkeypatch.setattr(SendRoomDriver, "_inline_rows", rows)
    cfg = {"limit": CFG.replace(status_inline_bytes=0), "progress": CFG.replace(copy_chunk_tokens=16)}.get(bad, CFG)
    if bad in ("limit", "progress"):  # the sender carries the small fields inline whatever the receiver said
        monkeypatch.setattr(SendRoomDriver, "_inline_fields", lambda self, task, peer: (1, 2))
    writer, _ = _recording()
    async with EmbeddingSender(LAYOUT, CFG, transport=writer) as sender, \
            EmbeddingReceiver(LAYOUT, cfg, connect=sender.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected()
        want = make_request(64, seed=12)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "bad", want)  # returns: its STATUS went out (a raise fails the test)
            with pytest.raises(TransferError, match=why):
                await receiver.receive("bad")
        # The small fields went by no write, and none of their rows was copied: still the pool's zeros.
        assert not receiver.pool.tensors["token_ids"].any() and not receiver.pool.tensors["mrope_positions"].any()
        await wait_pools_free(sender, receiver)
        # The pair still works for the next room (with the real rows).
        monkeypatch.undo()
        good = make_request(64, seed=13)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "good", good)
            assert same_rows(dict((await receiver.receive("good")).tensors), good)


def test_only_a_cpu_pool_takes_rows_inline() -> None:
    pool = BlockPool(LAYOUT, num_blocks=2, block_size=4)
    assert pool.status_inline_budget(8192) == 8192
    pool.device = torch.device("cuda", 0)  # as a CUDA pool says (its memory is not written by the loop)
    assert pool.status_inline_budget(8192) == 0
    with pytest.raises(PlanError, match="only by a transport"):
        pool.write_rows([0], [(1, b"\x00" * 16)], 4)


def test_a_first_status_with_the_most_metadata_and_rows_fits_a_frame() -> None:
    metadata = {"m": b"x" * (MAX_METADATA_BYTES - 16)}
    assert check_metadata(metadata, MAX_METADATA_BYTES) <= MAX_METADATA_BYTES
    msg = _status(room="r" * 256, metadata=metadata, inline=((0, b"y" * (MAX_INLINE_BYTES - 100)), (1, b"z" * 100)))
    assert len(encode(msg)) <= MAX_FRAME_BYTES
    assert decode(encode(msg)) == msg


async def test_metadata_and_rows_ride_together_and_streams_zero_copy_and_parts_get_them() -> None:
    """The first STATUS carries the metadata beside the rows; a zero-copy stream of a short room and a room
    assembled from two senders' parts get their small fields inline too."""
    a_writer, a_calls = _recording()
    b_writer, b_calls = _recording()
    async with EmbeddingSender(LAYOUT, CFG, transport=a_writer) as a, \
            EmbeddingSender(LAYOUT, CFG, transport=b_writer) as b, \
            EmbeddingReceiver(LAYOUT, CFG, connect=a.address, transport=MockTransport()) as receiver:
        await receiver.wait_connected(sender=a.address)
        await receiver.wait_connected(sender=b.address)
        want = make_request(50, seed=21)
        meta = {"image": "x" * 3000, "n": [1, 2, 3]}
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: a.send("m", want, metadata=meta))
            got = await receiver.receive("m")
        assert same_rows(dict(got.tensors), want) and got.metadata == meta
        assert _written(a_calls) == 50 * EMB

        a_calls.clear()
        leased: list[dict[str, torch.Tensor]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.send, "z", want)
            async with receiver.stream("z", zero_copy=True) as stream:
                async for chunk in stream:
                    with chunk:
                        leased.append(chunk.to_tensors())
        assert same_rows({k: torch.cat([c[k] for c in leased]) for k in want}, want)
        assert _written(a_calls) == 50 * EMB

        a_calls.clear()
        whole = make_request(120, seed=22)
        first = {k: v[:70] for k, v in whole.items()}
        second = {k: v[70:] for k, v in whole.items()}
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: a.send("p", first, part=0))
            tg.start_soon(lambda: b.send("p", second, part=1))
            got = await receiver.receive("p", parts=[Part(a.address, 0, 70), Part(b.address, 70, 120)])
        assert same_rows(dict(got.tensors), whole)
        assert _written(a_calls) == 70 * EMB and _written(b_calls) == 50 * EMB
        await wait_pools_free(a, receiver)
        await wait_pools_free(b, receiver)


_POOL_BLOCKS, _BS = 6, 4


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_write_rows_touches_exactly_the_rows_it_names_or_nothing(data: st.DataObject) -> None:
    """Whatever a peer sends (block lists, field numbers, lengths, rows): either exactly the named rows of the
    named fields change, in the named blocks' first tokens, or nothing does (PlanError). The memmoves stay inside
    the pool."""
    pool = BlockPool(LAYOUT, num_blocks=_POOL_BLOCKS, block_size=_BS)
    for t in pool.tensors.values():  # a known pattern everywhere, to see any stray byte
        t.view(torch.uint8).reshape(-1).copy_(torch.arange(t.numel() * t.element_size()) % 251)
    before = {k: v.clone() for k, v in pool.tensors.items()}
    # Mostly well-formed (so that writes happen and are checked), sometimes not.
    blocks = data.draw(st.one_of(st.lists(st.integers(0, _POOL_BLOCKS - 1), unique=True, max_size=4),
                                 st.lists(st.integers(-1, _POOL_BLOCKS), max_size=4)), label="blocks")
    tokens = data.draw(st.integers(0, len(blocks) * _BS) | st.integers(0, 5 * _BS), label="tokens")
    rows_by_field = list(LAYOUT.values())
    entries = data.draw(st.lists(st.tuples(
        st.sampled_from([0, 1, 2, 0, 1, 2, 3, 4]),  # 3, 4: fields the layout lacks
        st.sampled_from([0, 0, 0, 0, 0, 0, -2, -1, 1, 2]),  # rows' length off by this many bytes
    ), max_size=4, unique_by=lambda e: e[0]), label="entries")
    rows: list[tuple[int, bytes]] = []
    for i, off in sorted(entries):
        size = tokens * (rows_by_field[i].row_bytes if i < len(rows_by_field) else 8) + off
        rows.append((i, bytes((i * 37 + k) % 256 for k in range(max(0, size)))))
    valid = (all(0 <= b < _POOL_BLOCKS for b in blocks) and len(set(blocks)) == len(blocks)
             and tokens <= len(blocks) * _BS
             and all(i < len(rows_by_field) and len(d) == tokens * rows_by_field[i].row_bytes for i, d in rows))
    try:
        pool.write_rows(blocks, rows, tokens)
    except PlanError:
        assert not valid
        assert all(torch.equal(before[k], pool.tensors[k]) for k in before), "a refused write changed the pool"
        return
    assert valid
    names = list(LAYOUT)
    for j, name in enumerate(names):
        got, want = pool.tensors[name].view(torch.uint8).reshape(pool.num_tokens, -1), \
            before[name].view(torch.uint8).reshape(pool.num_tokens, -1).clone()
        data_j = dict(rows).get(j)
        if data_j:
            packed = torch.frombuffer(bytearray(data_j), dtype=torch.uint8).reshape(tokens, -1)
            for k in range(tokens):
                want[blocks[k // _BS] * _BS + k % _BS] = packed[k]
        assert torch.equal(got, want), f"field {name!r}: rows outside those named changed, or named rows are wrong"
