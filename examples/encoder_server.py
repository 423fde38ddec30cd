"""The encoder process of a disaggregated multimodal LLM: encodes images, sends the rows with aioembed.

Runs a small vision encoder (``tiny_vit.py``: random weights from a fixed seed) on the images it
is sent and hands each image's rows to the language model process with
``EmbeddingSender.send(room, rows, metadata)``. HTTP API:

* ``POST /encode`` ``{"room": str, "image": {"width", "height", "rgb": base64}, "metadata": {...},
  "part": int?}`` answers ``202 {"room", "part", "tokens", "grid"}`` at once; the encode and the
  transfer run in a background task owned by the app, and the language side learns the outcome
  from its ``receive(room)``. With ``part``, the image is part ``part`` of a multi-image room whose
  images the language server spread over several encoders (``send(room, rows, part=part)``).
  (Bad input: 400; a room already in flight: 409; shutting down: 503.)
* ``GET /healthz`` -> ``{"ok": true, "control_address": ..., ...}``: the control address is what
  a language server names as the sender of the rooms it sends there.

Run (transport from ``--config FILE``, else the ``AIOEMBED_*`` environment)::

    python examples/encoder_server.py --config examples/config.mooncake.toml --port 8001

It prints its control address and HTTP URL when ready; stop it with Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from aioembed import AioembedError, EmbeddingSender
from aioembed.protocol.messages import MAX_PARTS

from app_common import LOG_LEVELS, StopSignal, describe, load_config, port_number, run_main, serving, wait_any
from tiny_vit import LAYOUT, MODEL_NAME, PATCH, Image, TinyViT, build_model, encode

log = logging.getLogger("encoder_server")

MAX_ROOM_CHARS = 256


class EncoderService:
    """Owns the model and the background encode+send tasks of one encoder process.

    The tasks run in a task group opened by the app's lifespan. Stopping (:meth:`drain`) first
    refuses new rooms and lets the ones in flight finish for ``drain_seconds``, then cancels the
    rest: a cancelled ``send()`` aborts its room on the language side too, which then answers its
    client at once instead of waiting for a deadline.
    """

    def __init__(self, sender: EmbeddingSender, model: TinyViT, *, drain_seconds: float = 5.0,
                 hurry: anyio.Event | None = None) -> None:
        self.sender = sender
        self.model = model
        self.drain_seconds = drain_seconds
        self._hurry = hurry  # once set, a drain cancels what is in flight without waiting (a second signal)
        self.limiter = anyio.CapacityLimiter(1)  # one forward pass at a time: the CPU is the bottleneck
        self.in_flight: dict[str, anyio.CancelScope] = {}
        self.sent = 0
        self.failed = 0
        self._idle = anyio.Event()  # set whenever no room is in flight
        self._idle.set()
        self._tg: anyio.abc.TaskGroup | None = None
        self._accepting = False

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Accept work while the block runs (the app's lifespan); drain on the way out."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._accepting = True
            try:
                yield
            finally:
                with anyio.CancelScope(shield=True):
                    await self.drain()  # at once if the program drained already

    @property
    def accepting(self) -> bool:
        """True while the service takes new rooms."""
        return self._accepting

    async def drain(self) -> None:
        """Refuse new rooms, give those in flight ``drain_seconds``, then cancel the rest."""
        self._accepting = False
        with anyio.move_on_after(self.drain_seconds):
            await wait_any(self._idle, *(e for e in (self._hurry,) if e is not None))
        for scope in self.in_flight.values():
            scope.cancel()
        await self._idle.wait()  # a cancelled send() ends promptly; an encode ends with its thread

    def submit(self, room: str, image: Image, metadata: dict[str, Any], part: int | None = None) -> None:
        """Start encoding ``image`` and sending it as ``room`` (or as part ``part`` of it); returns at once."""
        if not self._accepting or self._tg is None:
            raise RuntimeError("the encoder is shutting down")
        scope = anyio.CancelScope()
        self.in_flight[_key(room, part)] = scope
        self._idle = anyio.Event()
        self._tg.start_soon(self._encode_and_send, room, part, image, metadata, scope)

    async def _encode_and_send(self, room: str, part: int | None, image: Image, metadata: dict[str, Any],
                               scope: anyio.CancelScope) -> None:
        # A room that never reaches send() (its encode failed, or the drain cancelled it while it waited for the
        # model) is aborted here: the language side asked for it before this encoder answered 202, and would
        # otherwise wait its whole input_timeout for rows that never come (send() ends the room itself otherwise).
        unsent: str | None = "the encoder stopped before sending it"
        try:
            with scope:
                t0 = time.perf_counter()
                async with self.limiter:  # the forward pass runs in a worker thread: the loop stays free
                    rows = await anyio.to_thread.run_sync(encode, self.model, image)
                rows_h, cols = image.grid
                meta = {**metadata, "model": MODEL_NAME, "image_size": [image.width, image.height],
                        "grid_thw": [1, rows_h, cols], "patch_size": PATCH,
                        "encode_seconds": round(time.perf_counter() - t0, 6)}
                unsent = None
                # Returns once the language side holds every row (of this part, for a multi-image room).
                await self.sender.send(room, rows, meta, part=part)
                self.sent += 1
            if scope.cancelled_caught:
                self.failed += 1
                unsent = unsent and "the encoder is shutting down"
                log.warning("room %s: cancelled (the encoder is shutting down)", room)
        except AioembedError as exc:
            self.failed += 1
            log.warning("room %s: transfer failed: %s: %s", room, type(exc).__name__, exc)
        except Exception as exc:  # keep serving other rooms whatever one room does
            self.failed += 1
            unsent = unsent and f"the encoder failed on the image: {type(exc).__name__}: {exc}"
            log.exception("room %s: encode failed", room)
        finally:
            if unsent is not None:
                try:
                    self.sender.abort(room, unsent, part=part)
                except AioembedError as exc:  # a part index the wire refuses: send() would have refused it too
                    log.warning("room %s: not aborted: %s", room, exc)
            del self.in_flight[_key(room, part)]
            if not self.in_flight:
                self._idle.set()


def _key(room: str, part: int | None) -> str:
    return room if part is None else f"{room}#{part}"


def build_app(service: EncoderService) -> Starlette:
    """The encoder's HTTP API around ``service`` (whose sender is already open)."""

    async def encode_route(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            room = body.get("room")
            if not isinstance(room, str) or not 0 < len(room) <= MAX_ROOM_CHARS:
                raise ValueError(f"room must be a string of 1..{MAX_ROOM_CHARS} characters")
            image = Image.from_json(body.get("image"))
            metadata = body.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise ValueError("metadata must be an object")
            part = body.get("part")
            if part is not None and (isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < MAX_PARTS):
                # Refused here, not by send() once the 202 went out (the language side would wait for the room).
                raise ValueError(f"part must be an integer in [0, {MAX_PARTS}) (this image's index in a multi-image "
                                 "room)")
        except ValueError as exc:  # includes JSON decoding errors
            return JSONResponse({"error": str(exc)}, status_code=400)
        if not service.accepting:
            return JSONResponse({"error": "the encoder is shutting down"}, status_code=503)
        if _key(room, part) in service.in_flight:
            return JSONResponse({"error": f"room {room!r} (part {part}) is already in flight"}, status_code=409)
        service.submit(room, image, metadata, part)
        rows, cols = image.grid
        return JSONResponse({"room": room, "part": part, "tokens": rows * cols, "grid": [1, rows, cols]},
                            status_code=202)

    async def healthz(request: Request) -> JSONResponse:
        sender = service.sender
        return JSONResponse({
            "ok": service.accepting, "role": "encoder", "model": MODEL_NAME,
            "control_address": sender.address, "transport": sender.config.transport,
            "peers": len(sender.peers), "rooms_in_flight": len(service.in_flight),
            "sent": service.sent, "failed": service.failed,
        }, status_code=200 if service.accepting else 503)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with service.running():
            yield

    return Starlette(routes=[Route("/encode", encode_route, methods=["POST"]),
                             Route("/healthz", healthz, methods=["GET"])], lifespan=lifespan)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options; each has an environment default so containers need no flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--config", default=os.environ.get("EXAMPLE_CONFIG"),
                   help="TOML transfer config (default: AIOEMBED_* environment variables)")
    p.add_argument("--host", default=os.environ.get("ENCODER_HOST", "127.0.0.1"), help="HTTP host")
    p.add_argument("--port", type=port_number, default=os.environ.get("ENCODER_PORT", "8001"),
                   help="HTTP port (0: any free port)")
    p.add_argument("--bind", default=os.environ.get("ENCODER_CONTROL_BIND", "tcp://127.0.0.1:0"),
                   help="ZeroMQ address of the sender's control socket (port 0: any free port)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random encoder weights")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="warning", help="logging level")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace, stop: StopSignal) -> int:
    """Open the sender, serve the app until a signal, drain, then close both in order."""
    config = load_config(args.config)
    model = build_model(args.seed)
    async with EmbeddingSender(LAYOUT, config, bind=args.bind) as sender:
        service = EncoderService(sender, model, hurry=stop.hurry)
        async with serving(build_app(service), args.host, args.port, log_level=args.log_level) as url:
            print(f"encoder_server: {describe(config)}", flush=True)
            print(f"encoder_server: control address {sender.address}", flush=True)
            print(f"encoder_server: serving on {url} (POST /encode, GET /healthz)", flush=True)
            await stop.wait()
            await service.drain()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the exit code (1 with a one-line message on a setup error)."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run_main("encoder_server", lambda stop: amain(args, stop))
    except (AioembedError, RuntimeError, OSError) as exc:
        print(f"encoder_server: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
