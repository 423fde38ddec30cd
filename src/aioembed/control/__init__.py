"""The control channel: ZeroMQ sockets driven by one I/O task each."""

from aioembed.control.channel import ControlSocket
from aioembed.control.sockets import make_dealer, make_router

__all__ = ["ControlSocket", "make_dealer", "make_router"]
