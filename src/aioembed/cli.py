"""The ``aioembed`` command: ``aioembed demo`` (an end-to-end transfer) and ``aioembed bench``."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
from collections.abc import Sequence

import anyio

from aioembed.config import TransferConfig
from aioembed.errors import AioembedError, InvalidRequest
from aioembed.transports.registry import check_transport_options

__all__ = ["main"]


async def _demo(args: argparse.Namespace) -> int:
    import torch

    from aioembed.samples import checksum, deterministic_request, standard_layout
    from aioembed.session.receiver import EmbeddingReceiver
    from aioembed.session.sender import EmbeddingSender

    config = TransferConfig.from_toml(args.config) if args.config else TransferConfig.from_env()
    # Before the header: a misspelt option was refused only once the sender opened its transport, after it.
    check_transport_options(config)
    layout = standard_layout(args.hidden)
    for tokens in args.tokens:  # before any request is built: a typo's rows can be more memory than the host has
        if not 0 < tokens <= config.max_request_tokens:
            raise InvalidRequest(f"--tokens {tokens}: a request is 1..{config.max_request_tokens} tokens "
                                 "(max_request_tokens)")
    print(f"aioembed demo: transport={config.transport}, layout={layout!r}")
    print(f"  default reservation {config.default_tokens} tokens, pool {config.pool_tokens} tokens, "
          f"block {config.block_size}")
    async with EmbeddingSender(layout, config, bind=args.bind) as sender, \
            EmbeddingReceiver(layout, config, connect=sender.address) as receiver:
        print(f"  sender listening on {sender.address}; receiver connected as rank 0 of 1")
        for i, tokens in enumerate(args.tokens):
            room = f"demo-{i}"
            data = deterministic_request(layout, tokens, room)
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send, room, data, {"request": i})
                got = await receiver.receive(room)
            dt = time.perf_counter() - t0
            same = all(torch.equal(got.tensors[n].view(torch.uint8), data[n].view(torch.uint8)) for n in data)
            mb = got.stats.bytes / 1e6
            print(f"  room {room}: {got.num_tokens} tokens, {got.rounds} round(s), {mb:.1f} MB in {dt * 1e3:.1f} ms "
                  f"= {mb / dt:.0f} MB/s, bit-for-bit {'equal' if same else 'DIFFERENT'} "
                  f"(sha256 {checksum(got.tensors)[:12]})")
            if not same:
                return 1
        st = receiver.allocator.stats
        print(f"  receive pool after the run: {st.free}/{st.total} blocks free")
    return 0


def _positive_int(text: str) -> int:
    """``argparse`` type of a width: ``--hidden 0`` was refused from deep inside as "field shape must be positive
    ints, got (0,)", which named no option."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aioembed", description="Move multimodal embeddings between processes.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run an end-to-end transfer in this process and print what moved")
    demo.add_argument("--config", help="TOML config file (default: AIOEMBED_* environment variables)")
    demo.add_argument("--bind", default="tcp://127.0.0.1:0")
    demo.add_argument("--hidden", type=_positive_int, default=3584, help="embedding width (bf16 values per token)")
    demo.add_argument("--tokens", type=int, nargs="+", default=[500, 8192, 20000],
                      help="request sizes in tokens (default: one small, one default-sized, one resumed)")
    demo.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    bench = sub.add_parser("bench", help="benchmark aioembed against the raw transport")
    from aioembed.bench.command import add_arguments

    add_arguments(bench)
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``aioembed`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo" and args.backend == "trio" and importlib.util.find_spec("trio") is None:
        # Offered, but no dependency of the core install: anyio's LookupError came as a traceback.
        parser.error("--backend trio needs the trio package, which the core install leaves out: pip install trio")
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            code = anyio.run(_demo, args, backend=args.backend)
        else:
            from aioembed.bench.command import run

            code = run(args)
    except (AioembedError, BaseExceptionGroup) as exc:
        error = _one_error(exc)
        if error is None:
            raise
        print(f"aioembed: error: {error}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def _one_error(exc: BaseException) -> AioembedError | None:
    """The error to report in one line: ``exc``, or the one error inside a task group's exception group (the
    demo's sender and receiver run in one: an ``InvalidRequest`` came wrapped, as a 48-line traceback)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, AioembedError) else None
