"""Both example servers in ONE process: the disaggregated setup on the loopback transport.

The loopback transport cannot cross processes, so to try the encoder/language split with nothing
but the core install (plus the ``examples`` extra: starlette, uvicorn, httpx), this runs the
unchanged ``encoder_server`` and ``language_server`` apps side by side in one event loop. They
still talk over real HTTP, and the rows still move through aioembed's control plane and the
transport; only the processes are merged::

    python examples/disaggregated_inprocess.py --config examples/config.loopback.toml
    curl -s localhost:8000/healthz

``--demo`` posts a few synthetic images of different sizes (one larger than the default
reservation, so it resumes), prints each summary and exits. Without ``--config`` the settings come
from the ``AIOEMBED_*`` environment, i.e. the embedded default (loopback) when it is unset.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx

from aioembed import AioembedError, EmbeddingReceiver, EmbeddingSender, TransferConfig

import encoder_server
import language_server
from app_common import LOG_LEVELS, StopSignal, describe, load_config, port_number, run_main, serving
from tiny_vit import LAYOUT, build_model, test_pattern

DEMO_SIZES = ((224, 224), (448, 336), (1344, 896))  # 64, 192 and 1536 image tokens


@dataclass(frozen=True)
class Running:
    """Where the two in-process servers listen."""

    encoder_url: str
    language_url: str
    control_address: str


@asynccontextmanager
async def running_inprocess(config: TransferConfig, *, host: str = "127.0.0.1", encoder_port: int = 0,
                            language_port: int = 0, seed: int = 0, log_level: str = "warning",
                            hurry: anyio.Event | None = None) -> AsyncIterator[Running]:
    """Run the encoder and language apps in this event loop while the block runs.

    Closes in the reverse order of opening, each side first letting its requests in flight
    finish (for a bounded time, cut short once ``hurry`` is set): language HTTP, receiver, encoder HTTP,
    sender.
    """
    model = build_model(seed)
    async with EmbeddingSender(LAYOUT, config) as sender:
        enc = encoder_server.EncoderService(sender, model, hurry=hurry)
        async with (
            serving(encoder_server.build_app(enc), host, encoder_port, log_level=log_level) as encoder_url,
            httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http,
            EmbeddingReceiver(LAYOUT, config, connect=sender.address) as receiver,
        ):
            await receiver.wait_connected()
            encoders = [language_server.Encoder(encoder_url, sender.address)]
            lang = language_server.LanguageService(receiver, http, encoders, hurry=hurry)
            try:
                async with serving(language_server.build_app(lang), host, language_port,
                                   log_level=log_level) as language_url:
                    try:
                        yield Running(encoder_url, language_url, sender.address)
                    finally:
                        with anyio.CancelScope(shield=True):  # bounded by the drain times
                            await lang.drain()
            finally:
                with anyio.CancelScope(shield=True):
                    await enc.drain()


async def demo(language_url: str) -> bool:
    """POST one synthetic image per size in ``DEMO_SIZES``; print each summary. True if all worked."""
    ok = True
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        for i, (w, h) in enumerate(DEMO_SIZES):
            image = test_pattern(w, h, seed=i)
            resp = await client.post(f"{language_url}/generate", json={"image": image.to_json(), "prompt": "?"})
            body = resp.json()
            if resp.status_code != 200 or body["tokens"] != image.num_tokens:
                print(f"  {w}x{h}: FAILED {resp.status_code} {json.dumps(body)[:300]}")
                ok = False
                continue
            emb = body["embedding"]
            print(f"  {w}x{h}: {body['tokens']} tokens in {body['rounds']} round(s), "
                  f"{body['bytes'] / 1e6:.2f} MB, transfer {body['seconds']['transfer'] * 1e3:.1f} ms, "
                  f"mean {emb['mean']:+.4f} std {emb['std']:.4f}, sha256 {body['sha256'][:16]}, "
                  f"grid {body['metadata']['grid_thw']}")
    return ok


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--config", default=os.environ.get("EXAMPLE_CONFIG"),
                   help="TOML transfer config (default: AIOEMBED_* environment variables, else loopback)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--encoder-port", type=port_number, default=8001, help="encoder HTTP port (0: any free port)")
    p.add_argument("--port", type=port_number, default=8000, help="language server HTTP port (0: any free port)")
    p.add_argument("--demo", action="store_true", help="post a few images, print the summaries and exit")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="warning")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace, stop: StopSignal) -> int:
    """Serve until a signal arrives, or run the demo and return."""
    config = load_config(args.config)
    async with running_inprocess(config, host=args.host, encoder_port=args.encoder_port,
                                 language_port=args.port, log_level=args.log_level, hurry=stop.hurry) as run:
        print(f"disaggregated_inprocess: {describe(config)}", flush=True)
        print(f"disaggregated_inprocess: encoder {run.encoder_url} (control {run.control_address})", flush=True)
        print(f"disaggregated_inprocess: serving on {run.language_url} (POST /generate, GET /healthz)",
              flush=True)
        if args.demo:
            return 0 if await demo(run.language_url) else 1
        await stop.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit code (1 with a one-line message on a setup error)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_main("disaggregated_inprocess", lambda stop: amain(args, stop))
    except (AioembedError, RuntimeError, OSError) as exc:
        print(f"disaggregated_inprocess: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
