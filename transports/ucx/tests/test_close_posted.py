"""``close_posted`` on an endpoint that is already closing: ucxx returns an empty close request, whose wrapper
crashes the process (SIGSEGV) when it is dropped. ``endpoint.alive`` stays true while a close request is in
flight, so the guard on ``alive`` does not catch it; the empty request is detected and kept instead.

The child runs ucxx as the transport does (``ensure_context``: blocking mode, progress only on the loop's
turns), so the first close cannot complete before the second call: with ucxx's default progress thread it
sometimes did under load, and the second call took the failed-endpoint path instead."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import asyncio, gc
    import ucxx
    from aioembed_ucx._context import ensure_context
    from aioembed_ucx._options import UcxOptions
    from aioembed_ucx._progress import close_posted, wait_request

    async def main():
        ensure_context(UcxOptions(tls="tcp", progress_mode="blocking"))
        got = asyncio.get_running_loop().create_future()
        async def handler(ep):
            got.set_result(ep)
            await asyncio.sleep(2)
        listener = ucxx.create_listener(handler)
        client = await ucxx.create_endpoint("127.0.0.1", listener.port)
        await got
        raw = client._ep
        first = close_posted(raw)
        assert first is not None and raw.alive  # alive until the close completes
        second = close_posted(raw)  # a close raced in: ucxx answers with an empty request
        assert second is None
        del second
        gc.collect()
        await wait_request(first)
        print("ok", flush=True)

    asyncio.run(main())
""")


def test_a_second_close_of_a_closing_endpoint_does_not_crash() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.returncode, proc.stdout, proc.stderr[-2000:])
