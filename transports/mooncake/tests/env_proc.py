"""In a fresh process (its first engine decides what the plugin sets for the process): opens endpoints with
different options and prints one JSON line: the environment after each step, every change a later endpoint
made to it (``os.putenv`` / ``os.unsetenv``, and whether the variable existed), what each endpoint took as
its timeouts, and what a protocol the running engines cannot share got. Used by test_engine_env.py."""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import anyio
from aioembed.errors import ConfigError, TransportError

import aioembed_mooncake._engine as engine_mod
from aioembed_mooncake import MooncakeTransport
from aioembed_mooncake._engine import EngineSettings, start_engine

NAMES = ("MC_FORCE_TCP", "MC_TRANSFER_TIMEOUT", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
TCP = {"protocol": "tcp", "hostname": "127.0.0.1"}


def env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in NAMES}


class Mutations:
    """Records the changes made to the C environment (os.environ goes through os.putenv / os.unsetenv)."""

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []
        self._putenv, self._unsetenv = os.putenv, os.unsetenv

    def __enter__(self) -> Mutations:
        def putenv(name: str | bytes, value: str | bytes) -> None:  # os.environ passes encoded names
            key = os.fsdecode(name)
            self.seen.append(["put", key, os.fsdecode(value), key in os.environ])
            self._putenv(name, value)

        def unsetenv(name: str | bytes) -> None:
            key = os.fsdecode(name)
            self.seen.append(["unset", key, None, key in os.environ])
            self._unsetenv(name)

        os.putenv, os.unsetenv = putenv, unsetenv  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.putenv, os.unsetenv = self._putenv, self._unsetenv  # type: ignore[assignment]


def timeouts(t: MooncakeTransport) -> list[float]:
    return [t.transfer_timeout, t.progress_timeout, t.write_lifetime]


async def main() -> None:
    out: dict[str, Any] = {"start": env()}
    async with await MooncakeTransport.open(dict(TCP, transfer_timeout=8)) as a:
        out["after_first"] = env()
        out["first"] = timeouts(a)
        with Mutations() as m:
            async with await MooncakeTransport.open(dict(TCP, transfer_timeout=12)) as b:
                out["second"] = timeouts(b)
                async with await MooncakeTransport.open(TCP) as c:
                    out["third"] = timeouts(c)
                    os.environ["MC_TRANSFER_TIMEOUT"] = "40"  # read when an endpoint opens, not later
                    out["third_after_change"] = timeouts(c)
                    os.environ["MC_TRANSFER_TIMEOUT"] = "30"
        out["mutations"] = m.seen
        out["after_second"] = env()
        settings = EngineSettings(hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="rdma",
                                  device_name="", transfer_timeout=None)
        try:
            await anyio.to_thread.run_sync(start_engine, settings)
            out["rdma_while_running"] = "started"
        except ConfigError as exc:
            out["rdma_while_running"] = str(exc)
    del a, b, c
    gc.collect()
    out["alive_after_close"] = len(getattr(engine_mod, "_live_engines", [None]))  # [None]: not tracked
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    try:
        anyio.run(main)
    except TransportError as exc:
        raise SystemExit(f"transport error: {exc}") from exc
