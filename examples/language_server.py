"""The language-model process of a disaggregated multimodal LLM: receives image embeddings with aioembed.

One language server, one receive pool, any number of encoder servers. For each ``POST /generate``
it names a room, lets a router pick an encoder for each image (the one with the fewest images in
flight), starts ``receiver`` on the room, asks the chosen encoders over HTTP to encode their
images for that room, and awaits the rows. A request with several images whose images went to
different encoders is one room assembled from parts (``receive(room, parts=[...])``): the language
side knows each image's token count from the request, so each part's token range is fixed before
anything is encoded. A real server would now splice the embeddings into the prompt at the
image-pad tokens and run the LLM; this example answers with a JSON summary of what arrived instead:
``{"room", "tokens", "rounds", "bytes", "encoders", "seconds": {...}, "embedding": {...}, "sha256",
"metadata", ...}``. A single-image room is *streamed*: the server consumes it in chunks as the rows
land (where a real server would run chunked prefill) and reports ``first_chunk_seconds`` next to
``last_byte_seconds``.

* ``POST /generate`` ``{"image": {"width", "height", "rgb": base64}, "prompt": str}`` or
  ``{"images": [image, ...], ...}`` -> 200 summary; 400 bad input, 502 an encoder or the transfer
  failed, 504 a transfer deadline passed.
* ``GET /healthz`` -> 200 once the receiver's handshake with every encoder holds, else 503.

Run after the encoders, with the same transport settings::

    python examples/language_server.py --config examples/config.mooncake.toml \\
        --encoder-url http://127.0.0.1:8001 --encoder-url http://127.0.0.1:8002 --port 8000

Each encoder's control address is asked from its ``/healthz`` unless ``--control-address`` is
given (one per ``--encoder-url``, in the same order).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aioembed import (
    AioembedError,
    Chunk,
    EmbeddingReceiver,
    InvalidRequest,
    Part,
    Received,
    ReceiveHandle,
    RoomStream,
    TransferError,
    TransferTimeout,
)
from aioembed.samples import checksum

from app_common import LOG_LEVELS, StopSignal, describe, load_config, port_number, run_main, serving, wait_any
from tiny_vit import IMAGE_PAD_ID, LAYOUT, Image, summarize_embeddings

log = logging.getLogger("language_server")

MAX_IMAGES = 64
"""Most images one request may carry."""


@dataclass
class Encoder:
    """One encoder server: where to ask (HTTP) and its sender's control address."""

    url: str
    control: str
    discovered: bool = False
    """The control address was asked from the encoder's ``/healthz`` (not given): ask again if the encoder
    restarted (on another port: the default ``--bind`` takes any free one)."""
    in_flight: int = 0
    """Images sent to it and not yet received."""
    images: int = 0
    """Images it was asked to encode so far."""


class Router:
    """Picks the encoder of each image: the one with the fewest images in flight, ties in turn.

    A real deployment's router may also weigh load reports or locality; what matters to aioembed
    is only that the language side names each room's (or each part's) sender.
    """

    def __init__(self, encoders: Sequence[Encoder]) -> None:
        if not encoders:
            raise ValueError("at least one encoder is needed")
        self.encoders = list(encoders)
        self._turn = 0

    def pick(self) -> Encoder:
        n = len(self.encoders)
        order = [self.encoders[(self._turn + i) % n] for i in range(n)]
        self._turn = (self._turn + 1) % n
        chosen = min(order, key=lambda e: e.in_flight)
        chosen.in_flight += 1
        chosen.images += 1
        return chosen


class LanguageService:
    """Turns one HTTP request into one room: route its images, ask the encoders, receive, summarise."""

    def __init__(self, receiver: EmbeddingReceiver, http: httpx.AsyncClient, encoders: Sequence[Encoder], *,
                 drain_seconds: float = 10.0, chunk_tokens: int = 256, hurry: anyio.Event | None = None) -> None:
        self.receiver = receiver
        self.http = http
        self.router = Router(encoders)
        self.drain_seconds = drain_seconds
        self._hurry = hurry  # once set, a drain aborts what is in flight without waiting (a second signal)
        self.chunk_tokens = chunk_tokens
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
            await wait_any(self._idle, *(e for e in (self._hurry,) if e is not None))
        for handle in list(self._handles):
            handle.cancel("the language server is shutting down")
        await self._idle.wait()

    async def generate(self, images: Sequence[Image], images_json: Sequence[dict[str, Any]],
                       prompt: str) -> tuple[int, dict[str, Any]]:
        """Returns (HTTP status, JSON body) for one request of one or more images."""
        if not self.accepting:
            return 503, {"error": "the language server is shutting down"}
        t0 = time.perf_counter()
        room = f"gen-{uuid.uuid4().hex}"
        chosen = [self.router.pick() for _ in images]
        try:  # every way out gives the router its images back
            return await self._generate(room, chosen, images, images_json, prompt_chars=len(prompt), t0=t0)
        finally:
            for enc in chosen:
                enc.in_flight -= 1

    async def _generate(self, room: str, chosen: Sequence[Encoder], images: Sequence[Image],
                        images_json: Sequence[dict[str, Any]], *, prompt_chars: int,
                        t0: float) -> tuple[int, dict[str, Any]]:
        for enc in {id(e): e for e in chosen}.values():
            await self.refresh(enc)
        # Start receiving *before* asking the encoders: the receive (handshakes, reservations, INIT
        # to each sender) runs concurrently with the HTTP calls and the encodes.
        stream: RoomStream[Chunk] | None = None
        try:
            if len(images) == 1 and self.chunk_tokens > 0:
                # One image: stream it, so that prefill could start on the first rows while the rest travel.
                stream = self.receiver.stream(room, sender=chosen[0].control, chunk_tokens=self.chunk_tokens)
                handle = stream.handle
            elif len(images) == 1:
                handle = self.receiver.start(room, sender=chosen[0].control)
            else:
                parts, at = [], 0
                for enc, image in zip(chosen, images, strict=True):
                    parts.append(Part(enc.control, at, at + image.num_tokens))
                    at += image.num_tokens
                handle = self.receiver.start(room, parts=parts)
        except InvalidRequest as exc:  # refused before anything started (e.g. over max_request_tokens)
            return 400, {"room": room, "error": f"{type(exc).__name__}: {exc}"}
        except AioembedError as exc:  # the receiver is closing
            return 503, {"room": room, "error": f"{type(exc).__name__}: {exc}"}
        self._handles.add(handle)
        self._idle = anyio.Event()
        try:
            refused = await self._ask_encoders(room, chosen, images_json, prompt_chars)
            http_seconds = time.perf_counter() - t0
            if refused is not None:
                handle.cancel("an encoder could not take its image")
                return refused
            streamed = await self._prefill_in_chunks(stream, t0) if stream is not None else {}
            got = await handle.result()
        except TransferTimeout as exc:
            return 504, {"room": room, "error": f"{type(exc).__name__}: {exc}"}
        except TransferError as exc:
            return 502 if self.accepting else 503, {"room": room, "error": f"{type(exc).__name__}: {exc}"}
        except BaseException:  # cancelled: abort the room on both sides, then go on cancelling
            handle.cancel("the request was cancelled")
            raise
        finally:
            if stream is not None:  # also one never iterated (an encoder refused): aborts the room if not complete
                with anyio.CancelScope(shield=True):
                    await stream.aclose()
            self._handles.discard(handle)
            if not self._handles:
                self._idle.set()
        self.served += 1
        body = summarize(got, seconds=time.perf_counter() - t0, encoder_http=http_seconds)
        body.update(streamed)
        body["encoders"] = [enc.url for enc in chosen]
        return 200, body

    async def refresh(self, enc: Encoder) -> None:
        """Ask the encoder its control address again when the receiver holds no session with it and the address
        was discovered: an encoder restarted on the default ``--bind`` listens on another port, and rooms named
        after the old one would wait for a handshake nobody answers. (After ``sender_idle_timeout`` the receiver
        closes an idle connection too: then the answer is the same address.)"""
        if not enc.discovered or self.receiver.connected_to(enc.control):
            return
        try:
            resp = await self.http.get(f"{enc.url}/healthz", timeout=2.0)
            address = resp.json().get("control_address")
        except (httpx.HTTPError, ValueError, AttributeError):
            return  # unreachable now: the room fails (or the health check says so) as before
        if isinstance(address, str) and address and address != enc.control:
            log.warning("encoder %s: control address %s -> %s (it restarted)", enc.url, enc.control, address)
            enc.control = address

    @staticmethod
    async def _prefill_in_chunks(stream: RoomStream[Chunk], t0: float) -> dict[str, Any]:
        """Consume the room chunk by chunk as the rows land. A real server would run a prefill step on
        each chunk here; this one checks the image-pad tokens per chunk and times the first and last."""
        first = last = 0.0
        sizes: list[int] = []
        pads = 0
        async with stream:
            async for chunk in stream:
                last = time.perf_counter() - t0
                first = first or last
                sizes.append(chunk.num_tokens)
                pads += int((chunk.tensors["token_ids"] == IMAGE_PAD_ID).sum().item())
        return {"chunks": sizes, "streamed_image_pad_tokens": pads,
                "first_chunk_seconds": round(first, 6), "last_byte_seconds": round(last, 6)}

    async def _ask_encoders(self, room: str, chosen: Sequence[Encoder], images_json: Sequence[dict[str, Any]],
                            prompt_chars: int) -> tuple[int, dict[str, Any]] | None:
        """POST each image to its encoder, concurrently; the first refusal as (status, body), else ``None``."""
        refusals: list[tuple[int, dict[str, Any]]] = []
        multi = len(chosen) > 1

        async def ask(i: int) -> None:
            enc = chosen[i]
            payload: dict[str, Any] = {"room": room, "image": images_json[i],
                                       "metadata": {"prompt_chars": prompt_chars, "image": i}}
            if multi:
                payload["part"] = i
            try:
                resp = await self.http.post(f"{enc.url}/encode", json=payload)
            except httpx.HTTPError as exc:
                refusals.append((502, {"room": room, "error": f"encoder unreachable at {enc.url}: {exc!r}"}))
                return
            if resp.status_code != 202:
                status = 400 if resp.status_code == 400 else 502
                refusals.append((status, {"room": room, "error": f"encoder {enc.url} answered {resp.status_code}: "
                                                                 f"{resp.text[:500]}"}))

        async with anyio.create_task_group() as tg:
            for i in range(len(chosen)):
                tg.start_soon(ask, i)
        return refusals[0] if refusals else None


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
        "part_metadata": list(got.part_metadata),
    }


def build_app(service: LanguageService) -> Starlette:
    """The language server's HTTP API around ``service`` (whose receiver is already open)."""

    async def generate(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            images_json = body["images"] if "images" in body else [body.get("image")]
            if not isinstance(images_json, list) or not 1 <= len(images_json) <= MAX_IMAGES:
                raise ValueError(f"images must be a list of 1..{MAX_IMAGES} images")
            images = [Image.from_json(j) for j in images_json]  # refuse bad input before a room is opened
            prompt = body.get("prompt", "")
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string")
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        status, payload = await service.generate(images, images_json, prompt)
        return JSONResponse(payload, status_code=status)

    async def connected(enc: Encoder) -> bool:
        """A session with the encoder holds, or one can be made now: the receiver closes a connection that has
        had no room for ``sender_idle_timeout``, and an idle server is as healthy as a busy one."""
        if r.connected_to(enc.control):
            return True
        if not service.accepting:
            return False
        await service.refresh(enc)
        try:
            await r.wait_connected(timeout=1.0, sender=enc.control)
        except AioembedError:
            return False
        return True

    r = service.receiver

    async def healthz(request: Request) -> JSONResponse:
        st = r.allocator.stats
        # Every encoder at once: each one unreachable costs its probe a second (more with a refresh), and one after
        # the other the answer took that many seconds per encoder down, past a readiness probe's timeout.
        up: dict[int, bool] = {}

        async def probe(i: int, enc: Encoder) -> None:
            up[i] = await connected(enc)

        async with anyio.create_task_group() as tg:
            for i, enc in enumerate(service.router.encoders):
                tg.start_soon(probe, i, enc)
        encoders = [{"url": e.url, "control_address": e.control, "connected": up[i],
                     "images": e.images, "in_flight": e.in_flight} for i, e in enumerate(service.router.encoders)]
        ok = service.accepting and all(e["connected"] for e in encoders)
        return JSONResponse({
            "ok": ok, "role": "language", "encoders": encoders,
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
    p.add_argument("--port", type=port_number, default=os.environ.get("LANGUAGE_PORT", "8000"),
                   help="HTTP port (0: any free port)")
    p.add_argument("--encoder-url", action="append", default=None,
                   help="an encoder server's HTTP URL; repeat for several encoders (default: $ENCODER_URLS, "
                        "comma-separated, else http://127.0.0.1:8001)")
    p.add_argument("--control-address", action="append", default=None,
                   help="an encoder's control address, one per --encoder-url in the same order (default: asked "
                        "from each encoder's /healthz; $ENCODER_CONTROL_ADDRESSES, comma-separated)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the encoder at startup")
    p.add_argument("--chunk-tokens", type=_tokens, default=os.environ.get("LANGUAGE_CHUNK_TOKENS", "256"),
                   help="stream single-image rooms in chunks of this many tokens (as a chunked prefill would take "
                        "them); 0: receive whole (default 256)")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="warning", help="logging level")
    args = p.parse_args(argv)
    if args.encoder_url is None:
        args.encoder_url = _env_list("ENCODER_URLS") or _env_list("ENCODER_URL") or ["http://127.0.0.1:8001"]
    if args.control_address is None:
        args.control_address = _env_list("ENCODER_CONTROL_ADDRESSES") or _env_list("ENCODER_CONTROL_ADDRESS")
    if args.control_address and len(args.control_address) != len(args.encoder_url):
        p.error(f"{len(args.control_address)} control addresses for {len(args.encoder_url)} encoders: give one "
                "per --encoder-url, or none")
    return args


def _tokens(text: str) -> int:
    """``argparse`` type of ``--chunk-tokens``: a count >= 0 (a negative one failed every request with a 500)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is not a number of tokens (>= 0; 0: receive whole)")
    return n


def _env_list(name: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, "").split(",") if x.strip()]


async def amain(args: argparse.Namespace, stop: StopSignal) -> int:
    """Connect to the encoder, serve until a signal, drain, then close in order."""
    config = load_config(args.config)
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as http:
        urls = [u.rstrip("/") for u in args.encoder_url]
        controls = args.control_address or [await discover_control_address(http, u, args.wait) for u in urls]
        encoders = [Encoder(u, c, discovered=not args.control_address) for u, c in zip(urls, controls, strict=True)]
        # One receiver and one pool for every encoder: each room names its sender (or its parts' senders).
        async with EmbeddingReceiver(LAYOUT, config) as receiver:
            for enc in encoders:
                await receiver.wait_connected(sender=enc.control)  # fail fast on a transport or layout mismatch
            service = LanguageService(receiver, http, encoders, chunk_tokens=args.chunk_tokens, hurry=stop.hurry)
            async with serving(build_app(service), args.host, args.port, log_level=args.log_level) as url:
                print(f"language_server: {describe(config)}", flush=True)
                for enc in encoders:
                    print(f"language_server: receiving from {enc.control} (encoder {enc.url})", flush=True)
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
