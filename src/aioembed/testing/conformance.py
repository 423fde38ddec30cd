"""Transport conformance suite: the tests every transport must pass.

A plugin runs it by subclassing::

    from aioembed.testing import TransportConformance

    class TestMyTransport(TransportConformance):
        transport_name = "mine"
        transport_options = {"protocol": "tcp"}
        backends = ("asyncio",)          # if the transport is asyncio-only

The suite opens two endpoints of the transport in this process (``endpoints`` fixture; a
plugin may override it), registers torch CPU buffers, and checks the byte-level contract
described in :mod:`aioembed.transports.base` by comparing real bytes.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, ClassVar

import anyio
import pytest
import torch

from aioembed.errors import ConfigError, TransportError
from aioembed.testing.event_loops import anyio_backends
from aioembed.transports.base import Link, MemoryRegion, Transport, WriteOp
from aioembed.transports.boundary import GuardedLink, GuardedTransport
from aioembed.transports.registry import open_transport

FOREIGN = (RuntimeError, ValueError, OSError)
"""What native engines raise instead of TransportError: the boundary must map each."""

__all__ = ["TransportConformance", "region_of"]


def region_of(t: torch.Tensor) -> MemoryRegion:
    """The memory region covering a contiguous tensor (``MemoryRegion.of_tensor``)."""
    return MemoryRegion.of_tensor(t)


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


class TransportConformance:
    """Subclass with ``transport_name`` (and options) to run the suite on a transport."""

    transport_name: ClassVar[str]
    transport_options: ClassVar[Mapping[str, Any]] = {}
    backends: ClassVar[tuple[str, ...]] = ("asyncio", "uvloop", "trio")
    """Event loops to run on (:data:`~aioembed.testing.event_loops.EVENT_LOOPS`); ("asyncio", "uvloop") for a
    transport that runs only on asyncio's loops."""
    large_bytes: ClassVar[int] = 64 << 20
    """Size of the large-write test; lower it for slow transports."""
    peer_gone_timeout: ClassVar[float] = 30.0
    """Seconds within which a write to a closed peer must fail."""
    closed_peer_seen_at_once: ClassVar[bool] = True
    """The first write after the peer's ``aclose()`` fails. False for a transport that cannot revoke a writer and
    may take a moment to learn of the close (NIXL over shared memory): writes may then succeed until one fails."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "anyio_backend" in metafunc.fixturenames:
            metafunc.parametrize("anyio_backend", anyio_backends(*self.backends))

    @pytest.fixture
    async def endpoints(self) -> AsyncIterator[tuple[Transport, Transport]]:
        """Two open endpoints of the transport under test: (writer, owner)."""
        a = await open_transport(self.transport_name, self.transport_options)
        try:
            b = await open_transport(self.transport_name, self.transport_options)
            try:
                yield a, b
            finally:
                await b.aclose()
        finally:
            await a.aclose()

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    async def _setup(
        endpoints: tuple[Transport, Transport], src_bytes: int, dst_bytes: int, seed: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, Link]:
        a, b = endpoints
        src = _random_bytes(src_bytes, seed)
        dst = torch.zeros(dst_bytes, dtype=torch.uint8)
        await a.register([region_of(src)])
        await b.register([region_of(dst)])
        link = await a.connect(b.descriptor())
        return src, dst, link

    @staticmethod
    def _ops(src: torch.Tensor, dst: torch.Tensor, spans: Sequence[tuple[int, int, int]]) -> list[WriteOp]:
        return [WriteOp(src.data_ptr() + s, dst.data_ptr() + d, n) for s, d, n in spans]

    @staticmethod
    def _expected(src: torch.Tensor, dst_len: int, spans: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        out = torch.zeros(dst_len, dtype=torch.uint8)
        for s, d, n in spans:
            out[d:d + n] = src[s:s + n]
        return out

    # -- tests ---------------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_descriptor_is_bytes(self, endpoints: tuple[Transport, Transport]) -> None:
        a, _ = endpoints
        desc = a.descriptor()
        assert isinstance(desc, bytes) and len(desc) > 0

    @pytest.mark.anyio
    async def test_single_write_is_visible(self, endpoints: tuple[Transport, Transport]) -> None:
        src, dst, link = await self._setup(endpoints, 4096, 4096)
        await link.write(self._ops(src, dst, [(0, 0, 4096)]))
        assert torch.equal(dst, src)
        await link.aclose()

    @pytest.mark.anyio
    @pytest.mark.parametrize("shape", ["reversed", "interleaved", "random", "adjacent"])
    async def test_many_op_shapes(self, endpoints: tuple[Transport, Transport], shape: str) -> None:
        chunk, n = 1536, 48
        src, dst, link = await self._setup(endpoints, chunk * n, chunk * n, seed=7)
        order = list(range(n))
        if shape == "reversed":
            order.reverse()
        elif shape == "interleaved":
            order = order[0::2] + order[1::2]
        elif shape == "random":
            random.Random(3).shuffle(order)
        # source chunk i goes to destination chunk order[i], each with a different length
        spans = [(i * chunk, order[i] * chunk, chunk - (i % 7) * 13) for i in range(n)]
        await link.write(self._ops(src, dst, spans))
        assert torch.equal(dst, self._expected(src, chunk * n, spans))
        await link.aclose()

    @pytest.mark.anyio
    async def test_large_write(self, endpoints: tuple[Transport, Transport]) -> None:
        n = self.large_bytes
        src, dst, link = await self._setup(endpoints, n, n, seed=11)
        half = n // 2
        await link.write(self._ops(src, dst, [(0, half, n - half), (n - half, 0, half)]))
        assert torch.equal(dst[half:], src[: n - half])
        assert torch.equal(dst[:half], src[n - half:])
        await link.aclose()

    @pytest.mark.anyio
    async def test_tiny_writes(self, endpoints: tuple[Transport, Transport]) -> None:
        n = 1000
        src, dst, link = await self._setup(endpoints, n, n, seed=13)
        spans = [(i, n - 1 - i, 1) for i in range(n)]
        await link.write(self._ops(src, dst, spans))
        assert torch.equal(dst, torch.flip(src, [0]))
        for i in range(0, 20):  # one op per call as well
            await link.write(self._ops(src, dst, [(i, i, 1)]))
        assert torch.equal(dst[:20], src[:20])
        await link.aclose()

    @pytest.mark.anyio
    async def test_empty_op_list_is_a_no_op(self, endpoints: tuple[Transport, Transport]) -> None:
        _src, dst, link = await self._setup(endpoints, 64, 64)
        await link.write([])
        assert int(dst.sum()) == 0
        await link.aclose()

    @pytest.mark.anyio
    async def test_concurrent_writes(self, endpoints: tuple[Transport, Transport]) -> None:
        tasks, chunk = 32, 64 * 1024
        src, dst, link = await self._setup(endpoints, tasks * chunk, tasks * chunk, seed=17)

        async def one(i: int) -> None:
            # each task writes its chunk as 4 reversed pieces
            q = chunk // 4
            spans = [(i * chunk + k * q, i * chunk + k * q, q) for k in reversed(range(4))]
            await link.write(self._ops(src, dst, spans))

        async with anyio.create_task_group() as tg:
            for i in range(tasks):
                tg.start_soon(one, i)
        assert torch.equal(dst, src)
        await link.aclose()

    @pytest.mark.anyio
    async def test_several_regions_on_both_sides(self, endpoints: tuple[Transport, Transport]) -> None:
        a, b = endpoints
        srcs = [_random_bytes(1000 + 100 * i, 20 + i) for i in range(3)]
        dsts = [torch.zeros(1000 + 100 * i, dtype=torch.uint8) for i in range(3)]
        await a.register([region_of(t) for t in srcs])
        await b.register([region_of(t) for t in dsts])
        link = await a.connect(b.descriptor())
        ops = [WriteOp(s.data_ptr(), d.data_ptr(), s.numel()) for s, d in zip(srcs, reversed(dsts), strict=True)
               if s.numel() == d.numel()]
        ops += [WriteOp(srcs[0].data_ptr(), dsts[2].data_ptr() + 5, 1000)]
        await link.write(ops)
        assert torch.equal(dsts[1], srcs[1])
        assert torch.equal(dsts[2][5:1005], srcs[0])
        await link.aclose()

    @pytest.mark.anyio
    async def test_bad_descriptors_are_refused(self, endpoints: tuple[Transport, Transport]) -> None:
        a, _ = endpoints
        rng = random.Random(5)
        for blob in [b"", b"\x00", b"not a descriptor", bytes(rng.randrange(256) for _ in range(300)),
                     b"\x81\xa9transport\xa7unknown"]:
            with pytest.raises(TransportError):
                await a.connect(blob)

    @pytest.mark.anyio
    async def test_write_outside_peer_regions_is_refused(self, endpoints: tuple[Transport, Transport]) -> None:
        src, dst, link = await self._setup(endpoints, 4096, 4096)
        with pytest.raises(TransportError):
            await link.write(self._ops(src, dst, [(0, 4096 - 100, 200)]))  # runs past the end
        with pytest.raises(TransportError):
            await link.write([WriteOp(src.data_ptr(), dst.data_ptr() + (1 << 40), 16)])
        assert int(dst.sum()) == 0
        await link.aclose()

    @pytest.mark.anyio
    async def test_write_from_unregistered_source(self, endpoints: tuple[Transport, Transport]) -> None:
        """Refused, unless the endpoint says it reads unregistered CPU sources: then it lands bit for bit."""
        a, _ = endpoints
        _, dst, link = await self._setup(endpoints, 64, 4096)
        stray = _random_bytes(4096, 99)
        if a.reads_unregistered("cpu"):
            await link.write([WriteOp(stray.data_ptr(), dst.data_ptr(), 4096)])
            assert torch.equal(dst, stray)
        else:
            with pytest.raises(TransportError):
                await link.write([WriteOp(stray.data_ptr(), dst.data_ptr(), 4096)])
            assert int(dst.sum()) == 0
        await link.aclose()

    @pytest.mark.anyio
    async def test_unregistered_destination_is_refused_whatever_the_sources(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """Reading unregistered sources never extends to destinations: a peer writes only into what was announced,
        from a registered source or (where the endpoint reads them) an unregistered one."""
        a, _ = endpoints
        src, dst, link = await self._setup(endpoints, 4096, 64)
        stray = torch.zeros(4096, dtype=torch.uint8)
        sources = [src] + ([_random_bytes(4096, 98)] if a.reads_unregistered("cpu") else [])
        for source in sources:
            with pytest.raises(TransportError):
                await link.write([WriteOp(source.data_ptr(), stray.data_ptr(), 4096)])
        assert int(stray.sum()) == 0 and int(dst.sum()) == 0
        await link.aclose()

    @pytest.mark.anyio
    async def test_overlapping_registrations(self, endpoints: tuple[Transport, Transport]) -> None:
        a, b = endpoints
        src = _random_bytes(8192, 31)
        dst = torch.zeros(8192, dtype=torch.uint8)
        whole, head = region_of(src), region_of(src[:4096])
        await a.register([whole])
        await a.register([whole, head])  # repeated and overlapping
        await b.register([region_of(dst)])
        link = await a.connect(b.descriptor())
        await a.unregister([whole])
        await a.unregister([head])
        await link.write(self._ops(src, dst, [(0, 0, 8192)]))  # still registered once
        assert torch.equal(dst, src)
        await a.unregister([whole])
        with pytest.raises(TransportError):
            await a.unregister([whole])
        await link.aclose()

    @pytest.mark.anyio
    async def test_write_after_link_close_fails(self, endpoints: tuple[Transport, Transport]) -> None:
        src, dst, link = await self._setup(endpoints, 64, 64)
        await link.aclose()
        with pytest.raises(TransportError):
            await link.write(self._ops(src, dst, [(0, 0, 64)]))

    @pytest.mark.anyio
    async def test_write_after_transport_close_fails(self, endpoints: tuple[Transport, Transport]) -> None:
        a, _ = endpoints
        src, dst, link = await self._setup(endpoints, 64, 64)
        await a.aclose()
        with pytest.raises(TransportError):
            await link.write(self._ops(src, dst, [(0, 0, 64)]))
        await a.aclose()  # idempotent

    @pytest.mark.anyio
    async def test_a_second_aclose_returns_once_the_first_finished(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """Two owners closing one endpoint (a shutdown path and a signal handler): neither ``aclose()`` returns
        while the endpoint is still closing, since its caller may then free memory it had registered."""
        a, _ = endpoints
        src, dst, link = await self._setup(endpoints, 4096, 4096)
        await link.write(self._ops(src, dst, [(0, 0, 4096)]))
        returned: list[str] = []

        async def close(name: str) -> None:
            await a.aclose()
            returned.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(close, "first")
            await anyio.lowlevel.checkpoint()  # the first close is under way
            tg.start_soon(close, "second")
        assert returned == ["first", "second"]
        with pytest.raises(TransportError):
            await link.write(self._ops(src, dst, [(0, 0, 64)]))

    @pytest.mark.anyio
    async def test_write_to_closed_peer_fails(self, endpoints: tuple[Transport, Transport]) -> None:
        """Writes to a peer whose endpoint closed fail within ``peer_gone_timeout``: the first one, unless the
        suite says ``closed_peer_seen_at_once = False`` (NIXL over shared memory: the peer's worker is gone, but
        a copy into memory that is still mapped needs nothing of it; seen once in CI, in-process), where a write
        in the moment before the transport learns of the close may still succeed; then one must fail."""
        _, b = endpoints
        src, dst, link = await self._setup(endpoints, 4096, 4096)
        await link.write(self._ops(src, dst, [(0, 0, 64)]))
        await b.aclose()
        with anyio.fail_after(self.peer_gone_timeout):
            while True:
                try:
                    await link.write(self._ops(src, dst, [(0, 0, 4096)]))
                except TransportError:
                    break
                assert not self.closed_peer_seen_at_once, "a write to a closed peer succeeded"
                await anyio.sleep(0.05)  # no event tells when the transport noticed: look again
        await link.aclose()

    # -- the plugin boundary -----------------------------------------------------------------

    @pytest.mark.anyio
    async def test_unknown_options_are_config_errors(self) -> None:
        with pytest.raises(ConfigError):
            await open_transport(self.transport_name, {**self.transport_options, "no_such_option_": 1})

    @pytest.mark.anyio
    async def test_capabilities_are_declared_consistently(self, endpoints: tuple[Transport, Transport]) -> None:
        a, _ = endpoints
        caps = a.capabilities
        assert a.write_lifetime >= 0 and a.orphan_lifetime >= 0
        # A failed write that may still land must be waited out for some time, or fences would end at once.
        assert caps.cancel_safe_writes or a.write_lifetime > 0
        assert isinstance(a.writer_id, str)

    @pytest.mark.anyio
    @pytest.mark.parametrize("exc_type", FOREIGN)
    @pytest.mark.parametrize("method", ["register", "connect", "write"])
    async def test_foreign_exceptions_become_transport_errors(
        self, endpoints: tuple[Transport, Transport], monkeypatch: pytest.MonkeyPatch, method: str,
        exc_type: type[Exception],
    ) -> None:
        a, b = endpoints
        assert isinstance(a, GuardedTransport), "sessions reach plugins only through the boundary"
        src, dst, link = await self._setup(endpoints, 4096, 4096)
        assert isinstance(link, GuardedLink)
        original = exc_type(f"native {method} failed")

        async def boom(*args: Any, **kwargs: Any) -> Any:
            raise original

        target = type(link.inner) if method == "write" else type(a.inner)
        monkeypatch.setattr(target, method, boom)
        with pytest.raises(TransportError) as info:
            if method == "register":
                await a.register([region_of(src[:128])])
            elif method == "connect":
                await a.connect(b.descriptor())
            else:
                await link.write(self._ops(src, dst, [(0, 0, 64)]))
        assert info.value.__cause__ is original
        assert exc_type.__name__ in str(info.value) and f"native {method} failed" in str(info.value)
        if method == "write":
            assert info.value.may_land is True  # an unexplained write failure is fenced
        monkeypatch.undo()
        await link.write(self._ops(src, dst, [(0, 0, 64)]))  # the endpoint still works
        assert torch.equal(dst[:64], src[:64])
        await link.aclose()

    @pytest.mark.anyio
    async def test_revoke_cuts_off_old_links_or_is_refused(self, endpoints: tuple[Transport, Transport]) -> None:
        a, b = endpoints
        src, dst, link = await self._setup(endpoints, 4096, 4096)
        if not b.capabilities.revocable:
            with pytest.raises(TransportError):
                await b.revoke(a.writer_id)
            await link.aclose()
            return
        await b.revoke(a.writer_id)
        with pytest.raises(TransportError):
            await link.write(self._ops(src, dst, [(0, 0, 64)]))  # opened before the revoke: cut off
        assert int(dst.sum()) == 0
        fresh = await a.connect(b.descriptor())  # opened after it: works
        await fresh.write(self._ops(src, dst, [(0, 0, 64)]))
        assert torch.equal(dst[:64], src[:64])
        await link.aclose()
        await fresh.aclose()
