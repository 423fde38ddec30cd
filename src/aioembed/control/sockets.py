"""Creating the control sockets: ROUTER on the sender (binds), DEALER on the receiver (connects).

Options are chosen for a long-running server: no linger on close, a hard cap on frame size
(memory stays bounded whatever a peer sends), fast reconnects after a peer restarts, errors
instead of silent drops when routing to a peer that is gone, and optional CURVE encryption
and authentication.
"""

from __future__ import annotations

import logging
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from aioembed.config import TransferConfig
from aioembed.errors import ConfigError
from aioembed.protocol.messages import MAX_FRAME_BYTES

__all__ = ["make_dealer", "make_router"]

log = logging.getLogger(__name__)

_HWM = 100_000


def _common(sock: zmq.Socket[bytes]) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)


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
