"""The ``anyio_backend`` parameters of :mod:`aioembed.testing.event_loops` run the loops they are named after."""

from __future__ import annotations

import asyncio

import pytest
import sniffio

from aioembed.testing.event_loops import EVENT_LOOPS, AnyioBackend, anyio_backends, backend_and_options


@pytest.fixture(params=anyio_backends())
def anyio_backend(request: pytest.FixtureRequest) -> AnyioBackend:
    return request.param


@pytest.mark.anyio
async def test_each_parameter_runs_the_loop_it_is_named_after(request: pytest.FixtureRequest) -> None:
    name = request.node.callspec.id
    library = sniffio.current_async_library()
    if name == "trio":
        assert library == "trio"
        return
    assert library == "asyncio"
    loop_module = type(asyncio.get_running_loop()).__module__
    assert loop_module.split(".")[0] == ("uvloop" if name == "uvloop" else "asyncio"), loop_module


def test_every_loop_is_offered_under_its_own_name() -> None:
    assert [p.id for p in anyio_backends()] == list(EVENT_LOOPS) == ["asyncio", "uvloop", "trio"]
    assert [p.id for p in anyio_backends("trio", "asyncio")] == ["trio", "asyncio"]
    with pytest.raises(ValueError, match="unknown event loop"):
        anyio_backends("tokio")


def test_a_backend_is_split_into_name_and_options_for_anyio_calls() -> None:
    assert backend_and_options("trio") == ("trio", {})
    assert backend_and_options(EVENT_LOOPS["uvloop"][0]) == ("asyncio", {"use_uvloop": True})
