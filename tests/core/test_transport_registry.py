"""Transport registry, loopback transport options and descriptors, RegionSet semantics."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aioembed import ConfigError, TransportError
from aioembed.testing import region_of
from aioembed.transports import (
    ENTRY_POINT_GROUP,
    MemoryRegion,
    RegionSet,
    Transport,
    WriteOp,
    available_transports,
    open_transport,
    resolve_transport,
)
from aioembed.transports import registry as registry_mod
from aioembed.transports.loopback import LoopbackTransport

# -- registry ---------------------------------------------------------------------------------


def test_available_includes_loopback() -> None:
    names = available_transports()
    assert "loopback" in names
    assert names == sorted(set(names))


def test_resolve_loopback() -> None:
    cls = resolve_transport("loopback")
    assert cls is LoopbackTransport
    assert issubclass(cls, Transport)
    assert cls.capabilities.cross_process is False
    assert cls.capabilities.cuda is False


def test_unknown_transport_lists_installed() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_transport("carrier-pigeon")
    msg = str(info.value)
    assert "carrier-pigeon" in msg
    assert "loopback" in msg
    assert ENTRY_POINT_GROUP in msg


@pytest.mark.parametrize("typo", ["loopbak", "Loopback", "loopback "])
def test_a_misspelt_transport_is_pointed_at_the_installed_one(typo: str) -> None:
    """The hint for an unknown name was ``pip install aioembed-<name>``: for a typo of an installed transport, a
    package that does not exist (or a squatter's), not the name the user meant."""
    with pytest.raises(ConfigError) as info:
        resolve_transport(typo)
    msg = str(info.value)
    assert f"unknown transport {typo!r}" in msg and "did you mean 'loopback'?" in msg
    assert "pip install" not in msg


@pytest.mark.anyio
async def test_open_unknown_transport(anyio_backend: str) -> None:
    with pytest.raises(ConfigError, match="nope"):
        await open_transport("nope")


class _FakeEP:
    def __init__(self, name: str, target: Any, value: str | None = None) -> None:
        self.name = name
        self.value = value or f"fake_module:{name}"
        self._target = target

    def load(self) -> Any:
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


class _PluginTransport(LoopbackTransport):
    name = "plugin-x"


def _fake_entry_points(eps: list[_FakeEP]) -> Any:
    def entry_points(*, group: str) -> list[_FakeEP]:
        assert group == ENTRY_POINT_GROUP
        return eps

    return entry_points


def test_plugins_from_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [
        _FakeEP("plugin-x", _PluginTransport),
        _FakeEP("broken", ImportError("no native lib")),
        _FakeEP("notatransport", dict),
        _FakeEP("notaclass", 42),
    ]
    monkeypatch.setattr(registry_mod, "entry_points", _fake_entry_points(eps))
    assert available_transports() == sorted(["loopback", "plugin-x", "broken", "notatransport", "notaclass"])
    assert resolve_transport("plugin-x") is _PluginTransport
    assert resolve_transport("loopback") is LoopbackTransport  # built-ins first
    with pytest.raises(TransportError, match="failed to load"):
        resolve_transport("broken")
    for name in ("notatransport", "notaclass"):
        with pytest.raises(TransportError, match="not a Transport subclass"):
            resolve_transport(name)
    with pytest.raises(ConfigError) as info:
        resolve_transport("ucx")
    assert "plugin-x" in str(info.value)


def test_a_name_two_plugins_register_is_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two installed distributions register one name (an old plugin left behind by a renamed one): which one loaded
    depended on the install order, silently. Now a ConfigError names both; the same target listed twice (one
    distribution seen on two paths) is no conflict."""
    eps = [_FakeEP("dup", _PluginTransport, "old_plugin:Transport"), _FakeEP("dup", LoopbackTransport, "new_plugin:T"),
           _FakeEP("twice", _PluginTransport), _FakeEP("twice", _PluginTransport)]
    monkeypatch.setattr(registry_mod, "entry_points", _fake_entry_points(eps))
    with pytest.raises(ConfigError, match="registered by 2 installed plugins") as info:
        resolve_transport("dup")
    assert "old_plugin:Transport" in str(info.value) and "new_plugin:T" in str(info.value)
    assert resolve_transport("twice") is _PluginTransport


# -- loopback options and descriptors ---------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "options",
    [{"protocol": "tcp"}, {"threads": 2, "bogus": 1}, {"inline_bytes": -1}, {"inline_bytes": 1.5},
     {"inline_bytes": True}, {"threads": 0}, {"threads": 257}, {"threads": True}, {"threads": "4"}],
)
async def test_loopback_bad_options(anyio_backend: str, options: Mapping[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        await open_transport("loopback", options)
    key = next(iter(options))
    assert key in str(info.value)


@pytest.mark.anyio
async def test_loopback_good_options(anyio_backend: str) -> None:
    t = await open_transport("loopback", {"threads": 1, "inline_bytes": 0})
    async with t:
        assert isinstance(t.inner, LoopbackTransport)  # behind the plugin boundary
        assert t.name == "loopback" and not t.closed
    assert t.closed


def _descriptor(**changes: Any) -> bytes:
    desc = {"transport": "loopback", "endpoint": "0" * 32, "pid": os.getpid(), "regions": [[4096, 64]]}
    desc.update(changes)
    return msgpack.packb(desc)


@pytest.mark.anyio
async def test_loopback_refuses_cross_process_descriptor(anyio_backend: str) -> None:
    async with await open_transport("loopback") as a, await open_transport("loopback") as b:
        buf = torch.zeros(64, dtype=torch.uint8)
        await b.register([region_of(buf)])
        real = msgpack.unpackb(b.descriptor(), raw=False)
        assert real["pid"] == os.getpid()
        forged = dict(real, pid=os.getpid() + 1)
        with pytest.raises(TransportError) as info:
            await a.connect(msgpack.packb(forged))
        msg = str(info.value)
        assert "process" in msg and str(os.getpid() + 1) in msg
        # the genuine descriptor connects
        link = await a.connect(b.descriptor())
        await link.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"\xc1garbage",
        msgpack.packb([1, 2, 3]),
        _descriptor(transport="mooncake"),
        msgpack.packb({"transport": "loopback"}),
        _descriptor(regions=[[0, 5]]),
        _descriptor(regions="x"),
        _descriptor(endpoint="does-not-exist"),
    ],
    # stable ids: some blobs hold this process's pid, and parallel workers must collect the same tests
    ids=["empty", "garbage", "a-list", "other-transport", "no-fields", "zero-address", "regions-not-a-list",
         "unknown-endpoint"],
)
async def test_loopback_bad_descriptors(anyio_backend: str, blob: bytes) -> None:
    async with await open_transport("loopback") as a:
        with pytest.raises(TransportError):
            await a.connect(blob)


@pytest.mark.anyio
async def test_loopback_closed_peer_and_write(anyio_backend: str) -> None:
    a = await open_transport("loopback")
    b = await open_transport("loopback")
    src = torch.arange(32, dtype=torch.uint8)
    dst = torch.zeros(32, dtype=torch.uint8)
    await a.register([region_of(src)])
    await b.register([region_of(dst)])
    link = await a.connect(b.descriptor())
    await link.write([WriteOp(src=src.data_ptr() + 4, dst=dst.data_ptr() + 10, length=8)])
    assert dst[10:18].tolist() == list(range(4, 12))
    assert int(dst[:10].sum()) == 0 and int(dst[18:].sum()) == 0
    desc = b.descriptor()
    await b.aclose()
    with pytest.raises(TransportError):
        await link.write([WriteOp(src=src.data_ptr(), dst=dst.data_ptr(), length=1)])
    with pytest.raises(TransportError, match="gone"):
        await a.connect(desc)
    await a.aclose()
    await a.aclose()  # idempotent
    with pytest.raises(TransportError):
        a.descriptor()


@pytest.mark.anyio
async def test_loopback_owner_keeps_no_record_of_writers_that_closed(anyio_backend: str) -> None:
    """An owner revokes each writer whose session it lost; one that outlives many writers must not keep an entry
    per writer (it grew by one per sender endpoint), while a revocation still refuses a live writer's old link."""
    owner = await LoopbackTransport.open({})
    dst = torch.zeros(16, dtype=torch.uint8)
    src = torch.arange(16, dtype=torch.uint8)
    await owner.register([region_of(dst)])
    for _ in range(3):
        writer = await LoopbackTransport.open({})
        await writer.register([region_of(src)])
        old = await writer.connect(owner.descriptor())
        await owner.revoke(writer.writer_id)
        with pytest.raises(TransportError, match="revoked"):
            await old.write([WriteOp(src=src.data_ptr(), dst=dst.data_ptr(), length=4)])
        new = await writer.connect(owner.descriptor())  # a new session: a new link, admitted
        await new.write([WriteOp(src=src.data_ptr(), dst=dst.data_ptr(), length=4)])
        assert dst[:4].tolist() == [0, 1, 2, 3]
        assert owner._generation == {writer.writer_id: 1}
        await writer.aclose()
        assert owner._generation == {}  # nothing left to refuse: it starts no write again
        await owner.revoke(writer.writer_id)  # the owner learns of the loss only now
        assert owner._generation == {}
        with pytest.raises(TransportError):
            await old.write([WriteOp(src=src.data_ptr(), dst=dst.data_ptr(), length=4)])
    assert dst[4:].sum() == 0
    await owner.aclose()


# -- MemoryRegion / RegionSet -----------------------------------------------------------------


@pytest.mark.parametrize(("address", "length"), [(0, 1), (-5, 10), (10, 0), (10, -1)])
def test_memory_region_validation(address: int, length: int) -> None:
    with pytest.raises(TransportError):
        MemoryRegion(address, length)


def R(a: int, n: int) -> MemoryRegion:
    return MemoryRegion(a, n)


def test_regionset_edges() -> None:
    rs = RegionSet([R(100, 50)])
    assert rs.covers(100, 50)
    assert rs.covers(100, 1) and rs.covers(149, 1)
    assert not rs.covers(99, 1)
    assert not rs.covers(99, 2)
    assert not rs.covers(150, 1)
    assert not rs.covers(149, 2)
    assert not rs.covers(100, 51)
    assert not rs.covers(120, 0)
    assert not rs.covers(120, -1)
    rs.check(110, 10, "x")
    with pytest.raises(TransportError, match="write source"):
        rs.check(140, 11, "write source")


def test_regionset_overlap_and_abutting_merge() -> None:
    rs = RegionSet([R(100, 50), R(150, 50)])  # abutting
    assert rs.covers(120, 60)  # crosses the seam
    assert rs.covers(100, 100)
    rs.add([R(180, 40)])  # overlapping the second
    assert rs.covers(100, 120)
    assert not rs.covers(100, 121)
    rs.add([R(300, 10)])  # a gap between 220 and 300
    assert not rs.covers(210, 100)
    assert rs.covers(300, 10)
    rs.add([R(120, 10)])  # nested inside
    assert rs.covers(100, 120)


def test_regionset_refcounts() -> None:
    a, b = R(1000, 100), R(1050, 100)
    rs = RegionSet()
    assert len(rs) == 0 and not rs.covers(1000, 1)
    assert rs.add([a]) == [a]
    assert rs.add([a]) == []  # second registration of the same region
    assert rs.add([b]) == [b]
    assert len(rs) == 3
    assert list(rs) == [a, b]
    assert rs.remove([a]) == []
    assert rs.covers(1000, 150)
    assert rs.remove([a]) == [a]
    assert not rs.covers(1000, 50)
    assert rs.covers(1050, 100)
    assert len(rs) == 1


def test_regionset_remove_unregistered_is_atomic() -> None:
    a, b = R(10, 10), R(30, 10)
    rs = RegionSet([a])
    with pytest.raises(TransportError, match="not registered"):
        rs.remove([a, b])
    assert len(rs) == 1 and rs.covers(10, 10)
    with pytest.raises(TransportError):
        rs.remove([a, a])  # only one registration held
    assert len(rs) == 1 and rs.covers(10, 10)
    with pytest.raises(TransportError):
        rs.remove([R(10, 9)])  # a different region, even if covered
    assert rs.remove([a]) == [a]
    assert len(rs) == 0


def test_regionset_same_span_different_device() -> None:
    rs = RegionSet([MemoryRegion(10, 10, "cpu"), MemoryRegion(10, 10, "cuda:0")])
    assert len(rs) == 2
    assert rs.remove([MemoryRegion(10, 10, "cpu")]) == [MemoryRegion(10, 10, "cpu")]
    assert rs.covers(10, 10)


@st.composite
def region_ops(draw: st.DrawFn) -> list[tuple[str, int, int, str]]:
    """Adds, checks, and removes: most of a region added before (any of them), some of one never added."""
    ops: list[tuple[str, int, int, str]] = []
    added: list[tuple[int, int, str]] = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["add", "add", "remove", "remove", "check"]))
        if kind == "remove" and added and draw(st.integers(0, 4)):
            a, n, dev = added[draw(st.integers(0, len(added) - 1))]
        else:
            a, n, dev = draw(st.integers(1, 60)), draw(st.integers(1, 30)), draw(st.sampled_from(["cpu", "cpu",
                                                                                                   "cuda:0"]))
        if kind == "add":
            added.append((a, n, dev))
        ops.append((kind, a, n, dev))
    return ops


@given(ops=region_ops())
@settings(max_examples=300, deadline=None)
def test_regionset_matches_byte_model(ops: list[tuple[str, int, int, str]]) -> None:
    # The merged spans are updated in place at each change (a removal re-merges only the span it was in), so
    # nested, overlapping, abutting and repeated regions, on one device or two, are all drawn here.
    rs = RegionSet()
    held: Counter[tuple[int, int, str]] = Counter()
    for kind, a, n, dev in ops:
        region = MemoryRegion(a, n, dev)
        if kind == "add":
            new = rs.add([region])
            assert new == ([region] if held[(a, n, dev)] == 0 else [])
            held[(a, n, dev)] += 1
        elif kind == "remove":
            if held[(a, n, dev)] == 0:
                with pytest.raises(TransportError):
                    rs.remove([region])
            else:
                gone = rs.remove([region])
                held[(a, n, dev)] -= 1
                assert gone == ([region] if held[(a, n, dev)] == 0 else [])
        covered = {x for (s, m, _), c in held.items() if c > 0 for x in range(s, s + m)}
        assert len(rs) == sum(held.values())
        for start in range(0, 95, 3):
            for length in (1, 2, 5, 17):
                want = all(x in covered for x in range(start, start + length))
                assert rs.covers(start, length) == want, (start, length)
