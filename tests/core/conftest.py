"""Fixtures shared by the core tests."""

from __future__ import annotations

import pytest

from aioembed.memory import huge_pages
from aioembed.testing.event_loops import anyio_backend_fixture

# Every async test of this folder runs on asyncio and on trio (no I/O here: uvloop would add nothing).
anyio_backend = anyio_backend_fixture("asyncio", "trio")


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
