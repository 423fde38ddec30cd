"""Creating the control sockets: ROUTER on the sender (binds), DEALER on the receiver (connects).

Options are chosen for a long-running server: no linger on close, a hard cap on frame size
(memory stays bounded whatever a peer sends), fast reconnects after a peer restarts, errors
instead of silent drops when routing to a peer that is gone, and optional CURVE encryption
and authentication.

What the kernel adds to the heartbeats (:mod:`aioembed.session.liveness`), one setting per side:

* The sender's ROUTER only answers, so a receiver whose host vanished without a FIN leaves it a half-open
  connection: the session ends after ``heartbeat_interval x heartbeat_misses`` of silence, but the TCP
  connection, ZeroMQ's pipe and whatever was queued on it (up to the high-water mark) stayed until the kernel
  gave up: 2 h 11 min of keepalive with Linux's defaults while nothing was unacknowledged, about 15 min of
  retransmits otherwise, and sends to that peer were swallowed instead of refused (``EHOSTUNREACH``). Keepalive
  probes after one silence window, and a retransmit timeout (``TCP_MAXRT``: Linux's ``TCP_USER_TIMEOUT``, which
  also bounds the probes) of two, drop it about twice the silence window after the peer's host last acknowledged
  anything: after the session already ended, so the kernel never ends a session the heartbeats still count live.
  A frozen receiver process keeps its connection (its kernel acknowledges), unless frames it stopped reading fill
  its window for that long (Linux applies the timeout to window probes too); then, like a paused host, it finds the
  connection reset when it thaws and shakes hands again, as its heartbeat would have had it do anyway.
* The receiver's DEALER finds a half-open connection itself (it drops a silent sender's connection and connects
  again, :meth:`~aioembed.control.channel.ControlSocket.reconnect`), so its keepalive keeps the kernel's timing: a
  drop from its own kernel in a live session (our loop stalled while the network was cut) would count as the sender
  closing it, and with its address not answering as proof that the sender is gone (see
  :mod:`aioembed.session.connection`), freeing blocks its writes may still reach. What it needs is a connect
  timeout: a connect to an address that drops packets waits for the kernel's SYN retransmits (1, 3, 7, 15, 31 and
  63 s after the first), so a sender host back at that address was reached only at the next one (up to a minute
  later) or after about 2 min, when ZeroMQ connected again.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from aioembed.config import TransferConfig
from aioembed.errors import ConfigError
from aioembed.protocol.messages import MAX_FRAME_BYTES

__all__ = ["CONNECT_TIMEOUT_FLOOR", "connect_timeout_ms", "make_dealer", "make_router", "router_tcp_options"]

log = logging.getLogger(__name__)

_HWM = 100_000

CONNECT_TIMEOUT_FLOOR = 1.0
"""Seconds: the least connect timeout. The kernel sends its first SYN again after 1 s: a shorter timeout only
abandons connects that were about to be retried anyway. With ``RECONNECT_IVL_MAX`` (1 s) a SYN goes out at
least every 2 s, so a peer host back at a black-holed address is reached within about 2 s."""

_MAX_KEEPALIVE_SECONDS = 32767
"""Linux's limit on ``TCP_KEEPIDLE`` and ``TCP_KEEPINTVL`` (larger values are refused)."""
_MAX_KEEPALIVE_PROBES = 127
"""Linux's limit on ``TCP_KEEPCNT``."""
_MAX_MILLISECONDS = (1 << 31) - 1


def _common(sock: zmq.Socket[bytes]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)


def router_tcp_options(config: TransferConfig) -> dict[int, int]:
    """The ROUTER's keepalive and retransmit timeout, from the heartbeat settings (see the module docstring):
    probes after one silence window, one per heartbeat interval, given up after two windows."""
    silence = config.heartbeat_interval * config.heartbeat_misses
    idle = min(_MAX_KEEPALIVE_SECONDS, max(1, _whole(silence)))
    interval = min(_MAX_KEEPALIVE_SECONDS, max(1, _whole(config.heartbeat_interval)))
    return {
        zmq.TCP_KEEPALIVE_IDLE: idle,
        zmq.TCP_KEEPALIVE_INTVL: interval,
        # With TCP_MAXRT set Linux gives up on the first probe past it (the count is not used there).
        zmq.TCP_KEEPALIVE_CNT: min(_MAX_KEEPALIVE_PROBES, config.heartbeat_misses),
        # Two windows as the keepalive counts them (at least 1 s each): with a window of a fraction of a second (a
        # test's heartbeats) one retransmit on a real network, or a receiver slow to read for a moment, cut live links.
        zmq.TCP_MAXRT: min(_MAX_MILLISECONDS, _whole(2 * max(silence, idle) * 1000)),
    }


def connect_timeout_ms(config: TransferConfig) -> int:
    """The DEALER's connect timeout: ``heartbeat_interval`` (a peer that tolerates that much delay between
    frames may take as long to answer a SYN), at least :data:`CONNECT_TIMEOUT_FLOOR`."""
    return min(_MAX_MILLISECONDS, _whole(max(CONNECT_TIMEOUT_FLOOR, config.heartbeat_interval) * 1000))


def _whole(value: float) -> int:
    """``value`` rounded up to a whole number, past float noise (0.05 x 3 x 2000 is 300.00000000000006)."""
    return math.ceil(round(value, 6))


def _load_cert(path: str, setting: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    p = Path(path)
    try:
        public, secret_key = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{setting}={path!r}: cannot load a ZeroMQ certificate: {exc}") from exc
    if secret and secret_key is None:
        raise ConfigError(f"{setting}={path!r} holds no secret key (use the '.key_secret' file)")
    return public, secret_key


def make_router(
    ctx: zmq.Context[zmq.Socket[bytes]], bind: str, config: TransferConfig
) -> tuple[zmq.Socket[bytes], str, ThreadAuthenticator | None]:
    """A bound ROUTER socket, its concrete address, and the CURVE authenticator if enabled."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    auth: ThreadAuthenticator | None = None
    try:
        _common(sock)
        for option, value in router_tcp_options(config).items():
            sock.setsockopt(option, value)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if config.curve_secret_key_file is not None:
            if config.curve_allowed_clients_dir is None:
                raise ConfigError("curve_secret_key_file is set on the sender but curve_allowed_clients_dir is not: "
                                  "name the directory of allowed client public keys")
            allowed = Path(config.curve_allowed_clients_dir)
            if not allowed.is_dir():
                raise ConfigError(f"curve_allowed_clients_dir={str(allowed)!r} is not a directory")
            public, secret = _load_cert(config.curve_secret_key_file, "curve_secret_key_file", secret=True)
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("aioembed.control.auth"))
            auth.start()
            auth.configure_curve(domain="*", location=str(allowed))
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_server = True
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot bind the control socket to {bind!r}: {exc}") from exc
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return sock, address, auth
    except BaseException:
        sock.close(linger=0)
        if auth is not None:
            auth.stop()
        raise


def make_dealer(ctx: zmq.Context[zmq.Socket[bytes]], connect: str, config: TransferConfig) -> zmq.Socket[bytes]:
    """A DEALER socket connecting to a sender's ROUTER."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    try:
        _common(sock)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, connect_timeout_ms(config))
        if config.curve_secret_key_file is not None or config.curve_server_public_key_file is not None:
            if config.curve_secret_key_file is None or config.curve_server_public_key_file is None:
                raise ConfigError("CURVE on a receiver needs both curve_secret_key_file (its own key pair) and "
                                  "curve_server_public_key_file (the sender's public key)")
            public, secret = _load_cert(config.curve_secret_key_file, "curve_secret_key_file", secret=True)
            server_public, _ = _load_cert(config.curve_server_public_key_file, "curve_server_public_key_file",
                                          secret=False)
            sock.curve_secretkey = secret
            sock.curve_publickey = public
            sock.curve_serverkey = server_public
        try:
            sock.connect(connect)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot connect the control socket to {connect!r}: {exc}") from exc
        return sock
    except BaseException:
        sock.close(linger=0)
        raise
