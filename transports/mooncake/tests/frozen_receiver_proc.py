"""A receiver in its own process for the frozen-receiver test (``test_frozen_receiver.py``).

Argv: the sender's address. Prints JSON lines: ``{"event": "a_started"}`` once room A is asked
for, ``{"event": "a_ended", "kind": ..., "fenced": [block ids]}`` when A fails, then
``{"event": "result", ...}`` once room B's lease was held across the release of A's blocks.
The test SIGSTOPs this process while the sender writes A, and resumes it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import torch
from aioembed import EmbeddingReceiver, TransferConfig, TransferError
from aioembed.protocol.ownership import GrantState
from aioembed.samples import deterministic_request, standard_layout

LAYOUT = standard_layout(256)
CONFIG = TransferConfig(
    transport="mooncake", transport_options={"protocol": "tcp", "hostname": "127.0.0.1"},
    default_tokens=1024, pool_tokens=32768, resume_reserve_tokens=0,
    # Declared dead after 2 s of silence: the frozen process is, and once resumed it must not be again.
    # (With 0.6 s, a resumed receiver catching up on a loaded host was declared silent a second time, and
    # room B's blocks were fenced and drained with A's.)
    heartbeat_interval=0.25, heartbeat_misses=8, handshake_timeout=5.0, input_timeout=60.0, round_timeout=60.0,
    # One write for A's whole round, so the whole round lands late. (Chunked, the sender would post no
    # chunk after the room failed, and only the chunks already in flight would land.)
    copy_chunk_tokens=0,
)
A_TOKENS, A_EXPECTED = 20000, 20096  # 157 blocks of 128
B_TOKENS, B_EXPECTED = 12000, 12672  # 99 blocks: with A's 157, the whole pool of 256


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(got[n].contiguous().view(torch.uint8), want[n].view(torch.uint8)) for n in want)


def rows_of(blocks: list[int], tokens: int) -> torch.Tensor:
    bs = CONFIG.block_size
    return torch.tensor([b * bs + i for b in blocks for i in range(bs)])[:tokens]


async def main(address: str) -> None:
    async with EmbeddingReceiver(LAYOUT, CONFIG, connect=address) as receiver:
        ledger = receiver.keeper.ledger
        await receiver.wait_connected()
        handle = receiver.start("A", expected_tokens=A_EXPECTED)
        with anyio.fail_after(10):  # A's reservation, as announced to the sender
            while not (grants := [g for g in ledger.grants(state=GrantState.ANNOUNCED) if g.room == "A"]):
                await anyio.sleep(0.005)
        a_blocks = sorted(grants[0].blocks)
        emit(event="a_started", blocks=len(a_blocks))
        try:
            await handle.result()
            emit(event="a_ended", kind="ok")
            return
        except TransferError as exc:
            emit(event="a_ended", kind=type(exc).__name__, error=str(exc))
        # The late write lands in the blocks it was announced for.
        want_a = deterministic_request(LAYOUT, A_TOKENS, "A")
        a_rows = rows_of(a_blocks, A_TOKENS)
        with anyio.move_on_after(30):
            while not same({n: receiver.pool.tensors[n][a_rows] for n in want_a}, want_a):
                await anyio.sleep(0.01)
        a_landed = same({n: receiver.pool.tensors[n][a_rows] for n in want_a}, want_a)
        # Room B takes every block A does not hold.
        async with receiver.lease("B", expected_tokens=B_EXPECTED) as lease:
            b_blocks = {b for g in ledger.grants() if g.room == "B" for b in g.blocks}
            released_before_b = receiver.keeper.released_total.get("DRAINED", 0)
            emit(event="b_leased", fenced_now=receiver.allocator.stats.fenced)
            with anyio.fail_after(60):  # hold it until A's write is known over and its blocks released
                while receiver.allocator.stats.fenced:
                    await anyio.sleep(0.02)
            b_intact = same(lease.to_tensors(), deterministic_request(LAYOUT, B_TOKENS, "B"))
        st = receiver.allocator.stats
        emit(event="result", a_landed=a_landed, b_intact=b_intact, overlap=len(b_blocks & set(a_blocks)),
             released_before_b=released_before_b, pool_free=st.free == st.total,
             released=dict(receiver.keeper.released_total))
        got = await receiver.receive("C")  # the same receiver, served again by the same sender
        emit(event="c", ok=same(got.tensors, deterministic_request(LAYOUT, 500, "C")))


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
