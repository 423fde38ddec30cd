"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest

from aioembed.memory import huge_pages
from aioembed.testing.event_loops import AnyioBackend, anyio_backends


@pytest.fixture(params=anyio_backends("asyncio", "trio"))
def anyio_backend(request: pytest.FixtureRequest) -> AnyioBackend:
    """Every async test of this folder runs on asyncio and on trio (no I/O here: uvloop would add nothing)."""
    return request.param


@pytest.fixture
def refused_huge_pages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernel refuses every huge-page advice from now on; the lengths it was asked for (one refusal
    should be enough: the advisor stops asking)."""
    advisor = huge_pages._HugePageAdvisor()
    calls: list[int] = []

    def refuse(address: int, length: int, advice: int) -> int:
        calls.append(length)
        return -1

    monkeypatch.setattr(advisor, "_madvise", refuse)
    monkeypatch.setattr(huge_pages, "_ADVISOR", advisor)
    return calls
