"""Asking a sender's address, after its control connection dropped, whether anything still listens there.

A dropped control connection alone does not prove that the sender's process ended. It also drops when the
*receiver's* kernel gives up on it (a sender whose host is paused, or cut off, for longer than TCP retransmits:
about 15 minutes with Linux's defaults), or when a middlebox resets it; in both cases the sender may still be
writing, and a paused host's writes go on when it thaws (over Mooncake's TCP transport the data connection stays
open at the receiver, which never times it out). Only the sender's host can say that nothing listens at the
address any more: a refused connection (TCP RST, or no listener on an ``ipc://`` path) is that word. What
answers, or says nothing, proves nothing.
"""

from __future__ import annotations

import enum
import socket

import anyio

__all__ = ["ProbeVerdict", "probe_address"]


class ProbeVerdict(enum.Enum):
    REFUSED = "refused"
    """The host answered that nothing listens at the address: the process that bound it closed it or ended."""
    ANSWERED = "answered"
    """Something accepts connections there (the sender, or a process that took the address over)."""
    NO_ANSWER = "no_answer"
    """Unreachable, timed out, or a name that does not resolve: nothing is known."""
    UNKNOWN = "unknown"
    """A transport this cannot probe (``inproc://``, ``pgm://``, ...)."""


def _tcp_target(rest: str) -> tuple[str, int]:
    """``host:port`` of a ZeroMQ ``tcp://`` address (``[v6]:port``, an optional ``source;`` prefix dropped)."""
    target = rest.rsplit(";", 1)[-1]
    host, _, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


async def _probe_tcp(host: str, port: int) -> ProbeVerdict:
    try:
        infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return ProbeVerdict.NO_ANSWER
    refused = 0
    for *_, sockaddr in infos:
        try:
            stream = await anyio.connect_tcp(str(sockaddr[0]), port)
        except OSError as exc:
            if isinstance(exc.__cause__, ConnectionRefusedError) or isinstance(exc, ConnectionRefusedError):
                refused += 1
            continue
        await stream.aclose()
        return ProbeVerdict.ANSWERED
    return ProbeVerdict.REFUSED if infos and refused == len(infos) else ProbeVerdict.NO_ANSWER


async def _probe_ipc(path: str) -> ProbeVerdict:
    if path.startswith("@"):
        path = "\0" + path[1:]  # Linux's abstract namespace, as ZeroMQ writes it
    try:
        stream = await anyio.connect_unix(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return ProbeVerdict.REFUSED
    except OSError:
        return ProbeVerdict.NO_ANSWER
    await stream.aclose()
    return ProbeVerdict.ANSWERED


async def probe_address(address: str, timeout: float) -> ProbeVerdict:
    """Connect to ZeroMQ endpoint ``address`` once (closing at once what answers), within ``timeout`` seconds.

    A connection to a sender's ROUTER that sends no ZeroMQ greeting is dropped by it; nothing reaches its
    sessions. Never raises for what the network says."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):
        return ProbeVerdict.UNKNOWN
    with anyio.move_on_after(timeout):
        if scheme == "ipc":
            return await _probe_ipc(rest)
        try:
            host, port = _tcp_target(rest)
        except ValueError:
            return ProbeVerdict.UNKNOWN
        return await _probe_tcp(host, port)
    return ProbeVerdict.NO_ANSWER
