"""Resolve a transport name to its implementation: built-ins first, then entry points."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from aioembed.errors import ConfigError, TransportError
from aioembed.transports.base import Transport
from aioembed.transports.boundary import GuardedTransport, open_guarded

__all__ = ["ENTRY_POINT_GROUP", "available_transports", "open_transport", "resolve_transport"]

ENTRY_POINT_GROUP = "aioembed.transports"


def _builtin() -> dict[str, type[Transport]]:
    from aioembed.transports.loopback import LoopbackTransport

    return {LoopbackTransport.name: LoopbackTransport}


def available_transports() -> list[str]:
    """Names of the built-in transports and of every installed plugin."""
    names = set(_builtin())
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def resolve_transport(name: str) -> type[Transport]:
    """The ``Transport`` subclass registered under ``name``."""
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        installed = available_transports()
        # A typo of an installed name ("mooncak", "UCX", "loopback ") was told to `pip install aioembed-mooncak`: a
        # package that does not exist, or a squatter's. Point at the installed name instead.
        near = difflib.get_close_matches(name.strip().lower(), installed, n=1, cutoff=0.8)
        hint = (f"did you mean {near[0]!r}?" if near else
                f"plugins register in the entry-point group {ENTRY_POINT_GROUP!r}, e.g. `pip install aioembed-{name}`")
        raise ConfigError(f"unknown transport {name!r}; installed transports: {installed} ({hint})")
    targets = {ep.value: ep for ep in matches}  # one distribution seen on two paths lists its target twice
    if len(targets) > 1:
        # Which one load() order picks depends on sys.path and install order: a silent pick could run the wrong
        # engine (an old plugin left behind by a renamed distribution) with the user's options.
        raise ConfigError(f"transport {name!r} is registered by {len(targets)} installed plugins, in the entry-point "
                          f"group {ENTRY_POINT_GROUP!r}: {', '.join(map(_describe, targets.values()))}; "
                          "uninstall all but one")
    try:
        cls = matches[0].load()
    except Exception as exc:
        raise TransportError(f"transport plugin {name!r} failed to load: {exc!r}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise TransportError(
            f"entry point {matches[0].value!r} for transport {name!r} is not a Transport subclass"
        )
    return cls


def _describe(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{ep.value} (from {dist.name} {dist.version})" if dist is not None else ep.value


async def open_transport(name: str, options: Mapping[str, Any] | None = None) -> GuardedTransport:
    """Open an endpoint of the transport named ``name``, behind the plugin boundary (any exception
    the plugin raises reaches the caller as ``TransportError`` or ``ConfigError``)."""
    return await open_guarded(resolve_transport(name), options or {})
