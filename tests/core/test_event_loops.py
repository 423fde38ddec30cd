"""The ``anyio_backend`` parameters of :mod:`aioembed.testing.event_loops` run the loops they are named after."""

from __future__ import annotations

import asyncio

import pytest
import sniffio

from aioembed.testing.event_loops import (
    EVENT_LOOPS,
    anyio_backend_fixture,
    anyio_backends,
    backend_and_options,
    run_on,
    running_loop,
)

anyio_backend = anyio_backend_fixture()


@pytest.mark.anyio
async def test_each_parameter_runs_the_loop_it_is_named_after(request: pytest.FixtureRequest) -> None:
    name = request.node.callspec.id
    assert running_loop() == name
    assert sniffio.current_async_library() == ("trio" if name == "trio" else "asyncio")
    if name != "trio":
        assert type(asyncio.get_running_loop()).__module__.split(".")[0] == name


def test_every_loop_is_offered_under_its_own_name() -> None:
    assert [p.id for p in anyio_backends()] == list(EVENT_LOOPS) == ["asyncio", "uvloop", "trio"]
    assert [p.id for p in anyio_backends("trio", "asyncio")] == ["trio", "asyncio"]
    with pytest.raises(ValueError, match="unknown event loop"):
        anyio_backends("tokio")


def test_a_backend_is_split_into_name_and_options_for_anyio_calls() -> None:
    assert backend_and_options("trio") == ("trio", {})
    assert backend_and_options(EVENT_LOOPS["uvloop"][0]) == ("asyncio", {"use_uvloop": True})
    assert run_on("uvloop") == ("asyncio", {"use_uvloop": True})
    assert run_on("asyncio") == ("asyncio", {})
    with pytest.raises(ValueError, match="unknown event loop 'tokio'"):
        run_on("tokio")
