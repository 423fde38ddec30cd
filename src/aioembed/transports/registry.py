"""Resolve a transport name to its implementation: built-ins first, then entry points."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, NoReturn

from aioembed.errors import ConfigError, TransportError
from aioembed.transports.base import Transport
from aioembed.transports.boundary import GuardedTransport, foreign_error, open_guarded

if TYPE_CHECKING:
    from aioembed.config import TransferConfig

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_transports",
    "check_transport_options",
    "open_configured",
    "open_transport",
    "resolve_transport",
]

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


def check_transport_options(config: TransferConfig) -> None:
    """Resolve ``config.transport`` and have it check ``config.transport_options`` (its
    :meth:`~aioembed.transports.base.Transport.check_options`) without opening anything.

    A refusal is a ``ConfigError`` naming the transport, the plugin's words about the option and where the config
    came from (:attr:`~aioembed.config.TransferConfig.source`). Meant for where a config is loaded: a misspelt
    option was otherwise refused only when the endpoint opened, after ``aioembed demo`` had printed its header,
    ``aioembed bench`` had started its progress bar, or a server had started everything before its sender. Any
    other exception out of the plugin's check is a ``TransportError``, as at every plugin call."""
    name = config.transport
    try:
        cls = resolve_transport(name)
    except ConfigError as exc:
        _raise_with_source(exc, config)
    try:
        cls.check_options(config.transport_options)
    except ConfigError as exc:
        _raise_with_source(ConfigError(f"transport {name!r} refused its transport_options: {exc}"), config, exc)
    except TransportError:
        raise
    except Exception as exc:  # a plugin's own bug: a TransportError, as at every plugin call (boundary.py)
        raise foreign_error(name, "check_options()", exc) from exc


async def open_configured(config: TransferConfig) -> GuardedTransport:
    """:func:`open_transport` of ``config.transport`` with its options; a ``ConfigError`` names where the config
    came from (:attr:`~aioembed.config.TransferConfig.source`) unless it already does: the plugin's refusal of an
    option named the option alone, and a server reading one of several files, or a container setting a few
    ``AIOEMBED_*`` variables, was not told which."""
    try:
        return await open_transport(config.transport, config.transport_options)
    except ConfigError as exc:
        _raise_with_source(exc, config)


def _raise_with_source(error: ConfigError, config: TransferConfig, cause: BaseException | None = None) -> NoReturn:
    """Raise ``error``, its message ending with ``config``'s source unless it has none or the message names it
    already (then ``error`` itself); ``cause`` (else ``error``) stays the ``__cause__`` of a new one."""
    source = config.source
    if not source or source in str(error):
        if cause is None:
            raise error
        raise error from cause
    raise ConfigError(f"{error} ({source})") from (cause or error)
