"""The language-model process of a disaggregated multimodal LLM: receives image embeddings with aioembed.

For each ``POST /generate`` it names a room, starts ``receiver`` on it, asks the encoder over
HTTP to encode the image for that room, and awaits the rows. A real server would now splice
the embeddings into the prompt at the image-pad tokens and run the LLM; this example answers
with a JSON summary of what arrived instead:
``{"room", "tokens", "rounds", "bytes", "seconds": {...}, "embedding": {"mean", "std", ...},
"sha256", "metadata", ...}``.

* ``POST /generate`` ``{"image": {"width", "height", "rgb": base64}, "prompt": str}`` -> 200 summary;
  400 bad input, 502 the encoder or the transfer failed, 504 a transfer deadline passed.
* ``GET /healthz`` -> 200 once the receiver's handshake with the encoder holds, else 503.

Run after the encoder, with the same transport settings::

    python examples/language_server.py --config examples/config.mooncake.toml \\
        --encoder-url http://127.0.0.1:8001 --port 8000

The encoder's control address is asked from its ``/healthz`` unless ``--control-address`` is given.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aioembed import AioembedError, EmbeddingReceiver, Received, ReceiveHandle, TransferError, TransferTimeout
from aioembed.samples import checksum

from app_common import StopSignal, describe, load_config, run_main, serving
from tiny_vit import IMAGE_PAD_ID, LAYOUT, Image, summarize_embeddings

log = logging.getLogger("language_server")


class LanguageService:
    """Turns one HTTP request into one room: ask the encoder, receive the rows, summarise them."""

    def __init__(self, receiver: EmbeddingReceiver, http: httpx.AsyncClient, encoder_url: str, *,
                 drain_seconds: float = 10.0) -> None:
        self.receiver = receiver
        self.http = http
        self.encoder_url = encoder_url.rstrip("/")
        self.drain_seconds = drain_seconds
        self.served = 0
        self.accepting = True
        self._handles: set[ReceiveHandle] = set()
        self._idle = anyio.Event()  # set whenever no request is in flight
        self._idle.set()

    async def drain(self) -> None:
        """Refuse new requests, give those in flight ``drain_seconds``, then abort their rooms.

        Run before the HTTP server stops, so that every client gets an answer (503 for the
        aborted ones) and uvicorn never has to cancel a request handler.
        """
        self.accepting = False
        with anyio.move_on_after(self.drain_seconds):
            await self._idle.wait()
        for handle in list(self._handles):
            handle.cancel("the language server is shutting down")
        await self._idle.wait()

    async def generate(self, image_json: dict[str, Any], prompt: str) -> tuple[int, dict[str, Any]]:
        """Returns (HTTP status, JSON body) for one image."""
        if not self.accepting:
            return 503, {"error": "the language server is shutting down"}
        t0 = time.perf_counter()
        room = f"gen-{uuid.uuid4().hex}"
        # Start receiving *before* asking the encoder: the receive (handshake, reservation of
        # default_tokens, INIT to the sender) runs concurrently with the HTTP call and the encode.
        handle = self.receiver.start(room)
        self._handles.add(handle)
        self._idle = anyio.Event()
        try:
            try:
                resp = await self.http.post(f"{self.encoder_url}/encode", json={
                    "room": room, "image": image_json, "metadata": {"prompt_chars": len(prompt)}})
            except httpx.HTTPError as exc:
                handle.cancel("the encoder could not be asked")
                return 502, {"room": room, "error": f"encoder unreachable at {self.encoder_url}: {exc!r}"}
            http_seconds = time.perf_counter() - t0
            if resp.status_code != 202:
                handle.cancel("the encoder refused the request")
                status = 400 if resp.status_code == 400 else 502
                return status, {"room": room, "error": f"encoder answered {resp.status_code}: {resp.text[:500]}"}
            got = await handle.result()
        except TransferTimeout as exc:
            return 504, {"room": room, "error": f"{type(exc).__name__}: {exc}"}
        except TransferError as exc:
            return 502 if self.accepting else 503, {"room": room, "error": f"{type(exc).__name__}: {exc}"}
        except BaseException:  # cancelled: abort the room on both sides, then go on cancelling
            handle.cancel("the request was cancelled")
            raise
        finally:
            self._handles.discard(handle)
            if not self._handles:
                self._idle.set()
        self.served += 1
        return 200, summarize(got, seconds=time.perf_counter() - t0, encoder_http=http_seconds)


def summarize(got: Received, *, seconds: float, encoder_http: float) -> dict[str, Any]:
    """What the language side would check before splicing the rows into a prompt."""
    pos = got.tensors["mrope_positions"]
    ids = got.tensors["token_ids"]
    return {
        "room": got.room,
        "tokens": got.num_tokens,
        "rounds": got.rounds,
        "bytes": got.stats.bytes,
        "seconds": {"request": round(seconds, 6), "encoder_http": round(encoder_http, 6),
                    "transfer": round(got.stats.seconds, 6),
                    **{k: round(v, 6) for k, v in got.stats.phases.items()}},
        "embedding": summarize_embeddings(got.tensors["embeddings"]),
        "image_pad_tokens": int((ids == IMAGE_PAD_ID).sum().item()),
        "mrope_grid": [int(pos[:, i].max().item()) + 1 for i in range(3)],
        "sha256": checksum(got.tensors),
        "metadata": got.metadata,
    }


def build_app(service: LanguageService) -> Starlette:
    """The language server's HTTP API around ``service`` (whose receiver is already open)."""

    async def generate(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            image_json = body.get("image")
            Image.from_json(image_json)  # refuse bad input here, before a room is opened
            assert isinstance(image_json, dict)  # from_json accepted it: an object
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        status, payload = await service.generate(image_json, prompt)
        return JSONResponse(payload, status_code=status)

    async def healthz(request: Request) -> JSONResponse:
        r = service.receiver
        st = r.allocator.stats
        ok = r.connected and service.accepting
        return JSONResponse({
            "ok": ok, "role": "language", "control_address": r.connect_to, "encoder_url": service.encoder_url,
            "transport": r.config.transport, "rooms_in_flight": r.rooms_in_flight, "served": service.served,
            "pool_blocks": {"free": st.free, "total": st.total, "fenced": st.fenced},
        }, status_code=200 if ok else 503)

    return Starlette(routes=[Route("/generate", generate, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])])


async def discover_control_address(http: httpx.AsyncClient, encoder_url: str, wait: float) -> str:
    """Ask the encoder's ``/healthz`` for its control address, retrying while it starts up."""
    deadline = anyio.current_time() + wait
    while True:
        try:
            resp = await http.get(f"{encoder_url.rstrip('/')}/healthz")
            address = resp.json().get("control_address")
            if isinstance(address, str) and address:
                return address
            problem = f"no control_address in {resp.text[:200]!r}"
        except (httpx.HTTPError, ValueError) as exc:
            problem = repr(exc)
        if anyio.current_time() > deadline:
            raise RuntimeError(f"could not reach the encoder at {encoder_url} within {wait} s: {problem}")
        await anyio.sleep(0.2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; each has an environment default so containers need no flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--config", default=os.environ.get("EXAMPLE_CONFIG"),
                   help="TOML transfer config (default: AIOEMBED_* environment variables)")
    p.add_argument("--host", default=os.environ.get("LANGUAGE_HOST", "127.0.0.1"), help="HTTP host")
    p.add_argument("--port", type=int, default=int(os.environ.get("LANGUAGE_PORT", "8000")),
                   help="HTTP port (0: any free port)")
    p.add_argument("--encoder-url", default=os.environ.get("ENCODER_URL", "http://127.0.0.1:8001"),
                   help="the encoder server's HTTP URL")
    p.add_argument("--control-address", default=os.environ.get("ENCODER_CONTROL_ADDRESS"),
                   help="the encoder's control address (default: asked from its /healthz)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the encoder at startup")
    p.add_argument("--log-level", default="warning", help="logging level (debug, info, warning)")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace, stop: StopSignal) -> int:
    """Connect to the encoder, serve until a signal, drain, then close in order."""
    config = load_config(args.config)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http:
        control = args.control_address or await discover_control_address(http, args.encoder_url, args.wait)
        async with EmbeddingReceiver(LAYOUT, config, connect=control) as receiver:
            await receiver.wait_connected()  # fail fast on a transport or layout mismatch
            service = LanguageService(receiver, http, args.encoder_url)
            async with serving(build_app(service), args.host, args.port, log_level=args.log_level) as url:
                print(f"language_server: {describe(config)}", flush=True)
                print(f"language_server: receiving from {control} (encoder {args.encoder_url})", flush=True)
                print(f"language_server: serving on {url} (POST /generate, GET /healthz)", flush=True)
                await stop.wait()
                await service.drain()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit code (1 with a one-line message on a setup error)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_main("language_server", lambda stop: amain(args, stop))
    except (AioembedError, RuntimeError, OSError) as exc:
        print(f"language_server: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
