"""The shortest complete aioembed program: one sender, one receiver, one request that resumes.

Runs in one process on the built-in ``loopback`` transport, so it needs nothing but the core
install::

    python examples/quickstart.py

The request has 20000 tokens while the receiver reserves 8192 before it knows the length
(``default_tokens``), so the transfer takes several rounds; the received rows are then compared
with the sent ones bit for bit.
"""

from __future__ import annotations

import anyio
import torch

from aioembed import EmbeddingReceiver, EmbeddingSender, Field, Layout, TransferConfig

TOKENS = 20000
HIDDEN = 1024
IMAGE_PAD_ID = 151655  # the token id a Qwen2-VL prompt uses for each image token

# Both sides declare the same per-token fields, in the same order (the handshake checks it).
LAYOUT = Layout(
    embeddings=Field((HIDDEN,), torch.bfloat16),
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)


def make_rows(num_tokens: int) -> dict[str, torch.Tensor]:
    """Stand-in encoder output: random embeddings, image-pad ids, (t, h, w) positions on a grid."""
    g = torch.Generator().manual_seed(0)
    width = 100
    idx = torch.arange(num_tokens)
    return {
        "embeddings": torch.randn(num_tokens, HIDDEN, generator=g).to(torch.bfloat16),
        "token_ids": torch.full((num_tokens,), IMAGE_PAD_ID, dtype=torch.int32),
        "mrope_positions": torch.stack([torch.zeros_like(idx), idx // width, idx % width], dim=1),
    }


async def main() -> int:
    """Send one request and check it; returns the process exit code."""
    config = TransferConfig()  # loopback, 8192-token default reservation, 128-token blocks
    rows = make_rows(TOKENS)
    async with (
        EmbeddingSender(LAYOUT, config) as sender,
        EmbeddingReceiver(LAYOUT, config, connect=sender.address) as receiver,
        anyio.create_task_group() as tg,
    ):
        # send() returns once the receiver holds every token; receive() returns the rows copied
        # out of the receiver's pool. Either side may start first.
        tg.start_soon(sender.send, "req-1", rows, {"image_sizes": [[2800, 2800]], "model": "quickstart"})
        got = await receiver.receive("req-1")
    same = all(torch.equal(got.tensors[n].view(torch.uint8), rows[n].view(torch.uint8)) for n in rows)
    print(f"tokens: {got.num_tokens}")
    print(f"rounds: {got.rounds} (default reservation {config.default_tokens} tokens)")
    print(f"metadata: {got.metadata}")
    print(f"bytes: {got.stats.bytes} in {got.stats.seconds * 1e3:.1f} ms")
    print(f"bit for bit: {'equal' if same else 'DIFFERENT'}")
    return 0 if same and got.num_tokens == TOKENS and got.rounds > 1 else 1


if __name__ == "__main__":
    raise SystemExit(anyio.run(main))
