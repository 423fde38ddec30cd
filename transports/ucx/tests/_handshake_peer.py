"""A UCX client that connects to a listener and never completes ucxx's peer-info exchange.

``python _handshake_peer.py HOST PORT MODE``; MODE ``silent``: connects and never sends its half (it
keeps progressing its worker); ``frozen``: receives the listener's half, then stops itself (SIGSTOP) in
the middle of the exchange and, once continued, sends its half. Prints ``connected`` once the UCX
endpoint is up (``frozen``: just before it stops), then ``closed`` once its endpoint failed (the
listener closed the connection), and exits once its parent is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import time

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def main() -> None:
    import ucxx
    from ucxx._lib.arr import Array
    from ucxx._lib.libucxx import UCXEndpoint

    host, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ucxx.init(options={"TLS": "tcp"}, progress_mode="blocking")
    worker = ucxx.core._get_ctx().worker
    ep = UCXEndpoint.create(worker, host, port, True)
    requests = []
    if mode == "frozen":
        theirs = bytearray(16)
        requests.append((ucxx_recv := ep.stream_recv(Array(theirs)), theirs))
        while not ucxx_recv.completed:
            worker.progress()
            time.sleep(0.001)
    else:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            worker.progress()
            time.sleep(0.005)
    print("connected", flush=True)
    if mode == "frozen":
        os.kill(os.getpid(), signal.SIGSTOP)
        mine = bytes(16)  # not a valid peer info: the listener must have given up on it anyway
        requests.append((ep.stream_send(Array(mine)), mine))
    parent = os.getppid()
    reported = False
    while os.getppid() == parent:
        worker.progress()
        if not reported:
            try:
                ep.raise_on_error()
            except Exception:
                print("closed", flush=True)
                reported = True
        time.sleep(0.01)


main()
