"""The floor peer of :mod:`aioembed.bench.control_floor`: run as a file (``python floor_peer.py SPEC``), so that
it imports only the standard library and pyzmq (not aioembed, not torch) and starts in a blink.

It connects a PAIR socket to the bench, says ``{"ready": true}`` on stdout, then answers until its stdin
closes or says ``{"op": "exit"}``: ``prime`` -> reads the clock (``t0``) and sends ``ask``; ``done`` -> reads the
clock (``t1``) and sends both readings. It blocks in ``zmq_poll`` meanwhile: the cheapest wake-up there is.
"""

from __future__ import annotations

import json
import struct
import sys
import time

import zmq

PRIME, ASK, DONE = b"prime", b"ask", b"done"
TIMES = struct.Struct("<dd")
"""The answer to ``done``: ``t0`` and ``t1`` (``time.monotonic``, seconds)."""


def serve(address: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    print(json.dumps({"ready": True}), flush=True)
    t0 = 0.0
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
        if sock in ready:
            msg = sock.recv()
            if msg == PRIME:
                t0 = time.monotonic()
                sock.send(ASK)
            elif msg == DONE:
                t1 = time.monotonic()
                sock.send(TIMES.pack(t0, t1))
        if sys.stdin in ready or sys.stdin.fileno() in ready:
            line = sys.stdin.readline()
            if not line or json.loads(line).get("op") == "exit":
                print(json.dumps({"exit": True}), flush=True)
                break
    sock.close(0)
    ctx.term()


if __name__ == "__main__":
    serve(json.loads(sys.argv[1])["address"])
