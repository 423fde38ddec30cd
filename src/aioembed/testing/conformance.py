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
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import anyio
import pytest
import torch

from aioembed.config import TransferConfig
from aioembed.errors import ConfigError, TransportError
from aioembed.testing.event_loops import anyio_backends
from aioembed.transports.base import Link, MemoryRegion, Transport, WriteOp
from aioembed.transports.boundary import GuardedLink, GuardedTransport
from aioembed.transports.registry import check_transport_options, open_transport, resolve_transport

FOREIGN = (RuntimeError, ValueError, OSError)
"""What native engines raise instead of TransportError: the boundary must map each."""

__all__ = ["TransportConformance", "endpoint_pair", "region_of"]


def region_of(t: torch.Tensor) -> MemoryRegion:
    """The memory region covering a contiguous tensor (``MemoryRegion.of_tensor``)."""
    return MemoryRegion.of_tensor(t)


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@asynccontextmanager
async def endpoint_pair(name: str, options: Mapping[str, Any]) -> AsyncIterator[tuple[Transport, Transport]]:
    """Two open endpoints of transport ``name`` (writer, owner), opened by name as the sessions open them and
    closed on leaving."""
    a = await open_transport(name, options)
    try:
        b = await open_transport(name, options)
        try:
            yield a, b
        finally:
            await b.aclose()
    finally:
        await a.aclose()


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
    quiet_window: ClassVar[float] = 1.0
    """Seconds the suite watches a destination for bytes that land later than the transport's capabilities allow,
    from the moment they allow nothing more (a write ended: cancelled, refused, its link or an endpoint closed,
    its writer revoked; or its ``write_lifetime`` / ``orphan_lifetime`` after that ran out)."""
    late_landing_wait: ClassVar[float] = 3.0
    """Seconds the suite waits at most for such a lifetime to run out before it watches. A check whose lifetime
    ends later is not made, and its test is skipped saying so (after its other checks): over TCP the plugins'
    lifetimes include the kernel's orphan retransmits (about 100 s), so a suite lowers them through its
    ``transport_options`` (``tcp_orphan_seconds``, a write timeout) to have these checks made."""
    in_flight_bytes: ClassVar[int] = 8 << 20
    """Size of the writes the suite cancels, revokes or closes around (large enough to be under way)."""
    closed_peer_seen_at_once: ClassVar[bool] = True
    """The first write after the peer's ``aclose()`` fails. False for a transport that cannot revoke a writer and
    may take a moment to learn of the close (NIXL over shared memory): writes may then succeed until one fails."""

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "anyio_backend" in metafunc.fixturenames:
            metafunc.parametrize("anyio_backend", anyio_backends(*self.backends))

    @pytest.fixture
    async def endpoints(self) -> AsyncIterator[tuple[Transport, Transport]]:
        """Two open endpoints of the transport under test: (writer, owner)."""
        async with endpoint_pair(self.transport_name, self.transport_options) as pair:
            yield pair

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

    @staticmethod
    async def _landed_late(dst: torch.Tensor, src: torch.Tensor, deadline: float, window: float) -> list[float]:
        """Watch ``dst`` for ``window`` seconds; from ``deadline`` (``anyio.current_time()``) on, its memory is
        reused as the sessions would reuse it: ``dst`` zeroed (a pool block handed to the next room) and ``src``
        scribbled over (a source released, its memory freed and reused). Returns, for each change seen after
        that, how long past ``deadline`` it may have happened at the earliest (the time of the last look that saw
        no change: a loaded host looks less often, which makes the check more lenient, never flaky). Nothing is
        watched when ``deadline`` lies past the window: nothing could be told."""
        start = anyio.current_time()
        end = start + window
        if deadline >= end:
            return []
        late: list[float] = []
        reused = False
        while True:
            t = anyio.current_time()
            if not reused and t >= deadline:
                dst.zero_()
                src.fill_(0x5A)
                reused = True
            seen = dst.clone()
            if t >= end:
                return late
            await anyio.sleep(0.01)
            if reused and not torch.equal(dst, seen):
                late.append(t - deadline)

    async def _watch_late(self, dst: torch.Tensor, src: torch.Tensor, deadline: float) -> list[float] | None:
        """:meth:`_landed_late` from ``deadline`` until ``quiet_window`` after it; None (nothing watched) where
        ``deadline`` lies more than ``late_landing_wait`` ahead."""
        ahead = deadline - anyio.current_time()
        if ahead > self.late_landing_wait:
            return None
        return await self._landed_late(dst, src, deadline, max(0.0, ahead) + self.quiet_window)

    def _judge_late(self, late: list[float] | None, what: str, allowed: str) -> str | None:
        """Fails on a late landing :meth:`_watch_late` saw; returns what was not watched, for
        :meth:`_skip_unwatched` (a check that cannot see a late landing must not pass as one that saw none)."""
        if late is None:
            return f"{what} (it may land until {allowed})"
        assert not late, self._late_message(what, late, allowed)
        return None

    def _skip_unwatched(self, unwatched: Sequence[str | None]) -> None:
        reasons = [r for r in unwatched if r is not None]
        if reasons:
            pytest.skip(f"late landings not watched, past late_landing_wait ({self.late_landing_wait} s): "
                        f"{'; '.join(reasons)}. Lower the lifetimes through transport_options (tcp_orphan_seconds, "
                        "a write timeout) to check them")

    @staticmethod
    def _late_message(what: str, late: list[float], allowed: str) -> str:
        return (f"{what}: bytes landed {len(late)} time(s) after {allowed} (the first at least {late[0]:.3f} s "
                "past it): a block the sessions free or hand on then is overwritten")

    async def _write_in_flight(self, link: Link, ops: list[WriteOp], outcome: list[Any]) -> None:
        """Write ``ops`` and note how it ended (``"landed"`` or the ``TransportError``) and when."""
        try:
            await link.write(ops)
        except TransportError as exc:
            outcome.append((exc, anyio.current_time()))
        else:
            outcome.append(("landed", anyio.current_time()))

    @asynccontextmanager
    async def _write_under_way(self, endpoints: tuple[Transport, Transport], seed: int
                               ) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor, Link, list[Any]]]:
        """A link from the first endpoint into the second's memory, with a write of ``in_flight_bytes`` under way
        in a task while the block runs (its outcome noted in the list: see :meth:`_write_in_flight`); the tensors
        are kept until the endpoints closed. The block waits for the write's end on leaving."""
        n = self.in_flight_bytes
        src, dst, link = await self._setup(endpoints, n, n, seed=seed)
        self._keep_alive(src, dst)
        outcome: list[Any] = []
        with anyio.fail_after(self.peer_gone_timeout + self.quiet_window + 30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write_in_flight, link, self._ops(src, dst, [(0, 0, n)]), outcome)
                await self._under_way()
                yield src, dst, link, outcome

    def _keep_alive(self, *tensors: torch.Tensor) -> None:
        """Keep ``tensors`` until the test's endpoints closed (the fixture ends after the test returns): a write
        a test left under way, which a transport may let land for a while, must not meet freed memory."""
        self.__dict__.setdefault("_kept", []).extend(tensors)

    @staticmethod
    async def _under_way() -> None:
        """Give a write just started a moment to be under way (one that is done by then makes the test that
        called this a plain one, never a failing one)."""
        for _ in range(3):
            await anyio.lowlevel.checkpoint()
        await anyio.sleep(0.005)

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
    async def test_a_refused_write_moves_nothing_of_its_good_ops(self, endpoints: tuple[Transport, Transport]) -> None:
        """One bad op refuses the whole write *before anything moves*: the ops before it must not have landed (a
        failed write whose blocks the sessions free at once, as ``may_land`` is false or the transport
        cancel-safe). Nothing lands later either."""
        a, _ = endpoints
        src, dst, link = await self._setup(endpoints, 8192, 4096)
        stray = torch.zeros(4096, dtype=torch.uint8)
        bad_ops = [
            [WriteOp(src.data_ptr() + 4096, stray.data_ptr(), 64)],  # destination never registered
            [WriteOp(src.data_ptr(), dst.data_ptr() + 4096 - 100, 200)],  # runs past the end
        ]
        if not a.reads_unregistered("cpu"):
            bad_ops.append([WriteOp(stray.data_ptr(), dst.data_ptr() + 2048, 64)])  # source never registered
        for bad in bad_ops:
            for where in ("last", "first"):
                good = self._ops(src, dst, [(0, 0, 1024), (4096, 3072, 1024)])
                ops = [*good, *bad] if where == "last" else [*bad, *good]
                with pytest.raises(TransportError):
                    await link.write(ops)
                assert int(dst.sum()) == 0, f"a refused write ({where} op bad: {bad[0]}) moved its good ops' bytes"
        late = await self._landed_late(dst, src, anyio.current_time(), min(self.quiet_window, 0.3))
        assert int(stray.sum()) == 0
        assert not late, self._late_message("refused writes", late, "they raised")
        await link.aclose()

    @pytest.mark.anyio
    async def test_a_write_into_the_gap_between_announced_regions_is_refused(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """Two destination regions with unregistered memory between them: a write into the gap, or across it, is
        refused and moves nothing (the span of the regions is not the regions)."""
        a, b = endpoints
        src = _random_bytes(4096, 43)
        whole = torch.zeros(3 * 4096, dtype=torch.uint8)
        await a.register([region_of(src)])
        await b.register([region_of(whole[:4096]), region_of(whole[2 * 4096:])])
        link = await a.connect(b.descriptor())
        base = whole.data_ptr()
        await link.write([WriteOp(src.data_ptr(), base + 2 * 4096, 4096)])  # the second region: fine
        assert torch.equal(whole[2 * 4096:], src)
        whole.zero_()
        for dst, n in [(base + 4096, 4096), (base + 4096 + 100, 64), (base + 4096 - 64, 128),
                       (base + 2 * 4096 - 64, 128)]:
            with pytest.raises(TransportError):
                await link.write([WriteOp(src.data_ptr(), dst, n)])
        assert int(whole.sum()) == 0, "a write landed outside the announced regions"
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

    def test_check_options_agrees_with_open(self) -> None:
        """``check_options`` (run where a config is loaded) accepts the options this suite opens endpoints with,
        and, where the plugin has a check of its own, refuses an unknown option as ``open()`` does, the refusal
        naming the transport, the option and where the config came from."""
        name = self.transport_name
        cls = resolve_transport(name)
        cls.check_options(self.transport_options)
        if cls.check_options.__func__ is Transport.check_options.__func__:  # type: ignore[attr-defined]
            return  # no check of its own: open() checks
        config = TransferConfig.from_mapping(
            {"transport": name, "transport_options": {**self.transport_options, "no_such_option_": 1}},
            source="conformance.toml")
        with pytest.raises(ConfigError) as info:
            check_transport_options(config)
        msg = str(info.value)
        assert msg.startswith(f"transport {name!r} refused its transport_options: "), msg
        assert "'no_such_option_'" in msg and msg.endswith("(in conformance.toml)"), msg

    @pytest.mark.anyio
    async def test_capabilities_are_declared_consistently(self, endpoints: tuple[Transport, Transport]) -> None:
        a, _ = endpoints
        caps = a.capabilities
        assert a.write_lifetime >= 0 and a.orphan_lifetime >= 0
        # A failed write that may still land must be waited out for some time, or fences would end at once.
        assert caps.cancel_safe_writes or a.write_lifetime > 0
        assert isinstance(a.writer_id, str)

    @pytest.mark.anyio
    async def test_reads_unregistered_is_one_safe_answer_per_device(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """``reads_unregistered`` never raises, is a bool, and does not change while the endpoint lives (a sender
        asks once, at start, and then writes from its caller's tensors unstaged); true for a CUDA device only
        where the transport moves CUDA memory (else its engine would read a device address as host memory)."""
        a, _ = endpoints
        devices = ["cpu", "cuda:0", "cuda:1", "cuda:7"]
        plugin = getattr(a, "inner", a)  # the plugin's own answer: the boundary would hide a raise as "false"
        first = {d: plugin.reads_unregistered(d) for d in devices}
        assert all(isinstance(v, bool) for v in first.values()), first
        for d in devices[1:]:
            assert not first[d] or a.capabilities.cuda, (
                f"reads_unregistered({d!r}) is true, but capabilities.cuda is false: the sender would hand the "
                "transport device pointers to read as host memory")
        src, dst, link = await self._setup(endpoints, 4096, 4096)
        await link.write(self._ops(src, dst, [(0, 0, 4096)]))
        answers = {d: plugin.reads_unregistered(d) for d in devices}
        assert answers == first, f"the answer changed once memory was registered: {first} -> {answers}"
        await a.unregister([region_of(src)])
        answers = {d: plugin.reads_unregistered(d) for d in devices}
        assert answers == first, f"the answer changed as memory was unregistered: {first} -> {answers}"
        await link.aclose()

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

    # -- when a write that ended may still land (block ownership) ------------------------------------------

    @pytest.mark.anyio
    @pytest.mark.parametrize("cancel_after", [0.0, 0.02])
    async def test_a_cancelled_write_lands_only_as_its_capabilities_allow(
        self, endpoints: tuple[Transport, Transport], cancel_after: float
    ) -> None:
        """A write cancelled under way (``fail_after`` around it, as the sessions' round timeout does): on a
        ``cancel_safe_writes`` transport nothing of it lands once the cancellation reached the caller, nor is its
        source read again (the sessions free its blocks and let go of its source at once); on any other, nothing
        lands past ``write_lifetime`` (then the blocks are unfenced). From an unregistered source too, where the
        endpoint reads those (the sender's caller then frees its tensors)."""
        a, _ = endpoints
        n = self.in_flight_bytes
        src, dst, link = await self._setup(endpoints, n, n, seed=37)
        self._keep_alive(src, dst)
        sources = [src] + ([_random_bytes(n, 38)] if a.reads_unregistered("cpu") else [])
        self._keep_alive(*sources)
        unwatched: list[str | None] = []
        for source in sources:
            dst.zero_()
            failed: TransportError | None = None
            with anyio.move_on_after(cancel_after) as scope:
                try:
                    await link.write([WriteOp(source.data_ptr(), dst.data_ptr(), n)])
                except TransportError as exc:  # a cancelled write may say so as a failure, with may_land / settled
                    failed = exc
            ended = anyio.current_time()
            if failed is not None:
                deadline, allowed = await self._failure_deadline(a, failed, ended)
            elif not scope.cancelled_caught:
                assert torch.equal(dst, source)  # done before the cancel came: it must then be whole
                deadline, allowed = ended, "the write returned"
            elif a.capabilities.cancel_safe_writes:
                deadline, allowed = ended, "it was cancelled (cancel_safe_writes is true)"
            else:
                deadline, allowed = ended + a.write_lifetime, f"write_lifetime ({a.write_lifetime} s)"
            late = await self._watch_late(dst, source, deadline)
            unwatched.append(self._judge_late(late, f"a write cancelled after {cancel_after} s", allowed))
        await link.aclose()
        self._skip_unwatched(unwatched)

    async def _failure_deadline(self, a: Transport, failed: TransportError, ended: float) -> tuple[float, str]:
        """From when a write that raised ``failed`` at ``ended`` may land nothing more, as the sessions read it:
        at once with ``may_land`` false (or unset on a cancel-safe transport); else after ``write_lifetime``, and,
        with ``settled``, not before ``orphan_lifetime`` after that returned (the later of the two)."""
        may_land = failed.may_land if failed.may_land is not None else not a.capabilities.cancel_safe_writes
        if not may_land:
            return ended, "it failed with may_land false"
        deadline, allowed = ended + a.write_lifetime, f"write_lifetime ({a.write_lifetime} s)"
        if failed.settled is not None:
            with anyio.fail_after(max(self.quiet_window, a.write_lifetime) + 30):
                await failed.settled()
            settled_at = anyio.current_time() + a.orphan_lifetime
            if settled_at > deadline:
                deadline, allowed = settled_at, "settled() returned, plus orphan_lifetime"
        return deadline, allowed

    @pytest.mark.anyio
    async def test_a_write_failed_by_its_link_closing_lands_only_as_it_says(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """The link closed under a write (a sender dropping a receiver): the write lands, or fails. A failure with
        ``may_land`` false (or, unset, on a cancel-safe transport) lands nothing after it raised; any other lands
        nothing past ``write_lifetime`` after it raised, and, if it has ``settled``, nothing past
        ``orphan_lifetime`` after that returned (the sessions unfence at the later of the two)."""
        a, _ = endpoints
        async with self._write_under_way(endpoints, seed=39) as (src, dst, link, outcome):
            await link.aclose()
        result, ended = outcome[0]
        if result == "landed":
            assert torch.equal(dst, src)
            deadline, allowed = ended, "the write returned"
        else:
            deadline, allowed = await self._failure_deadline(a, result, ended)
        late = await self._watch_late(dst, src, deadline)
        self._skip_unwatched([self._judge_late(late, "a write whose link closed under it", allowed)])

    @pytest.mark.anyio
    async def test_revoke_returns_once_writes_already_landing_ended(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """``revoke()`` with a write of the writer under way: once it returned nothing lands any more (the
        receiver frees the writer's blocks on that proof alone), whether the write then ends as landed or not."""
        a, b = endpoints
        if not b.capabilities.revocable:
            pytest.skip(f"transport {self.transport_name!r} is not revocable (the refusal is checked elsewhere)")
        async with self._write_under_way(endpoints, seed=41) as (src, dst, link, _):
            await b.revoke(a.writer_id)
            late = await self._landed_late(dst, src, anyio.current_time(), self.quiet_window)
        assert not late, self._late_message("a write under way when its writer was revoked", late, "revoke() returned")
        await link.aclose()

    @pytest.mark.anyio
    async def test_an_owner_closing_returns_once_writes_into_its_memory_ended(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """The owner of the memory closes its endpoint with a peer's write under way: once ``aclose()`` returned,
        nothing lands in that memory any more (a receiver frees its pool right after, fenced blocks included)."""
        _, b = endpoints
        async with self._write_under_way(endpoints, seed=43) as (src, dst, link, _):
            await b.aclose()
            late = await self._landed_late(dst, src, anyio.current_time(), self.quiet_window)
        assert not late, self._late_message("a write into an endpoint closing under it", late, "its aclose() returned")
        await link.aclose()

    @pytest.mark.anyio
    async def test_a_writer_closing_lands_nothing_past_its_orphan_lifetime(
        self, endpoints: tuple[Transport, Transport]
    ) -> None:
        """The writer closes its endpoint with one of its writes under way (a sender shutting down): nothing of it
        lands past ``orphan_lifetime`` after ``aclose()`` returned, nor is its source read then (the sender frees
        its staging memory once its endpoint closed)."""
        a, _ = endpoints
        async with self._write_under_way(endpoints, seed=47) as (src, dst, _, _):
            await a.aclose()
            deadline = anyio.current_time() + a.orphan_lifetime
            late = await self._watch_late(dst, src, deadline)
        self._skip_unwatched([self._judge_late(late, "a write whose endpoint closed under it",
                                               f"aclose() returned, plus orphan_lifetime ({a.orphan_lifetime} s)")])
