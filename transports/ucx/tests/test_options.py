"""Options, per-process settings, the entry point, the missing-extra error and trio refusal."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from aioembed import EmbeddingSender, Field, Layout, TransferConfig
from aioembed.errors import ConfigError, TransportError
from aioembed.transports.base import MemoryRegion, WriteOp
from aioembed.transports.registry import available_transports, open_transport, resolve_transport

import aioembed_ucx
from aioembed_ucx import UcxOptions, UcxTransport
from aioembed_ucx._options import tls_may_use_rdma

from .conftest import UCX_OPTIONS

pytestmark = pytest.mark.anyio


def test_entry_point_resolves_to_the_plugin() -> None:
    assert "ucx" in available_transports()
    assert resolve_transport("ucx") is UcxTransport
    caps = UcxTransport.capabilities
    assert caps.asyncio_only and caps.cuda and caps.cross_process


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"protocol": "tcp"}, "protocol"),
        ({"tls": ""}, "tls"),
        ({"tls": 5}, "tls"),
        ({"tls": "tcp,carrier_pigeon"}, "carrier_pigeon"),
        ({"host": ""}, "host"),
        ({"host": "0.0.0.0"}, "host"),
        ({"host": "not a host!"}, "host"),
        ({"port": -1}, "port"),
        ({"port": 70000}, "port"),
        ({"port": True}, "port"),
        ({"progress_mode": "fast"}, "progress_mode"),
        ({"write_timeout": 0}, "write_timeout"),
        ({"write_timeout": "5"}, "write_timeout"),
        ({"write_timeout": float("nan")}, "write_timeout"),
        ({"connect_timeout": -1.0}, "connect_timeout"),
        ({"inline_bytes": -1}, "inline_bytes"),
        ({"eager_bytes": -1}, "eager_bytes"),
        ({"eager_bytes": (64 << 20) + 1}, "eager_bytes"),
        ({"eager_bytes": 1.5}, "eager_bytes"),
        ({"max_connections": 0}, "max_connections"),
        ({"max_connections": -1}, "max_connections"),
        ({"max_connections": (1 << 16) + 1}, "max_connections"),
        ({"max_connections": 8.0}, "max_connections"),
        ({"max_connections": "8"}, "max_connections"),
        ({"max_connections": True}, "max_connections"),
        ({"max_connection": 8}, "did you mean 'max_connections'"),
        ({"ucx_options": {"UCX_TLS": "tcp"}}, "ucx_options"),
        ({"ucx_options": {"TLS": "tcp"}}, "tls"),
        ({"ucx_options": {"rndv_scheme": "put_zcopy"}}, "ucx_options"),
        ({"ucx_options": "RNDV_SCHEME=put_zcopy"}, "ucx_options"),
    ],
)
def test_bad_options_name_the_option(options: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        UcxOptions.parse(options)


def test_good_options_parse() -> None:
    o = UcxOptions.parse({"tls": "TCP, cuda_copy", "host": "localhost", "port": 0, "progress_mode": "polling",
                          "write_timeout": 2, "ucx_options": {"RNDV_SCHEME": "put_zcopy", "TCP_KEEPIDLE": 5}})
    assert o.tls == "tcp,cuda_copy" and o.write_timeout == 2.0
    assert o.ucx_options == {"RNDV_SCHEME": "put_zcopy", "TCP_KEEPIDLE": "5"}
    assert UcxOptions.parse({}).tls is None  # leave UCX_TLS to UCX by default
    assert UcxOptions.parse({}).eager_bytes == 1 << 20 and UcxOptions.parse({"eager_bytes": 0}).eager_bytes == 0
    assert UcxOptions.parse({}).max_connections == 1024
    assert UcxOptions.parse({"max_connections": 1}).max_connections == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_per_process_settings_must_agree(anyio_backend: str) -> None:
    async with await open_transport("ucx", UCX_OPTIONS):
        other = dict(UCX_OPTIONS, progress_mode="thread" if UCX_OPTIONS["progress_mode"] != "thread" else "polling")
        with pytest.raises(ConfigError, match="once per process"):
            await open_transport("ucx", other)
        # per-endpoint settings may differ
        async with await open_transport("ucx", dict(UCX_OPTIONS, write_timeout=1.0, host="localhost")) as t:
            assert t.host == "127.0.0.1"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_missing_ucxx_names_the_extra(anyio_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> Any:
        if name == "ucxx":
            raise ImportError("No module named 'ucxx'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(ConfigError, match=r"aioembed-ucx\[cu12\]"):
        await open_transport("ucx", UCX_OPTIONS)
    assert aioembed_ucx.UcxTransport is UcxTransport  # the package itself imports without ucxx


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_trio_is_refused_clearly(anyio_backend: str) -> None:
    with pytest.raises(ConfigError, match=r"only under asyncio.*trio"):
        await open_transport("ucx", UCX_OPTIONS)
    layout = Layout(x=Field((4,), torch.float32))
    with pytest.raises(ConfigError, match="asyncio"):
        async with EmbeddingSender(layout, TransferConfig(transport="ucx", transport_options=UCX_OPTIONS)):
            pass


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_descriptor_errors(anyio_backend: str) -> None:
    async with await open_transport("ucx", UCX_OPTIONS) as t:
        with pytest.raises(TransportError, match="cpu' or 'cuda:N"):
            from aioembed.transports.base import MemoryRegion
            await t.register([MemoryRegion(4096, 16, "tpu:0")])


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_cuda_memory_with_a_tls_that_cannot_move_it_is_refused_at_register() -> None:
    from aioembed.transports.base import MemoryRegion

    t = await open_transport("ucx", UCX_OPTIONS)  # tls="tcp" (one UCX setting per process)
    try:
        with pytest.raises(ConfigError, match=r"transport_options\.tls") as info:
            await t.register([MemoryRegion(1 << 40, 4096, "cuda:0")])  # refused before anything touches it
        assert "cuda_copy" in str(info.value) or "excludes" in str(info.value)
        await t.register([MemoryRegion(1 << 40, 4096, "cpu")])  # CPU memory is fine with it
    finally:
        await t.aclose()


def test_which_tls_settings_can_move_cuda_memory() -> None:
    for tls in (None, "all", "tcp,cuda_copy", "rc,cuda_copy,cuda_ipc", "^rc"):
        assert UcxOptions.parse({} if tls is None else {"tls": tls}).cuda_problem({}) is None
    for tls in ("tcp", "tcp,sm", "^cuda_copy,cuda_ipc", "^cuda"):
        problem = UcxOptions.parse({"tls": tls}).cuda_problem({})
        assert problem is not None and "transport_options.tls" in problem
    assert UcxOptions.parse({}).cuda_problem({"UCX_TLS": "tcp"}) is not None  # the environment counts


def test_which_tls_settings_may_use_rdma() -> None:
    """Where UCX may move host memory over RDMA, a CPU source is not read unregistered (a pin per request)."""
    for tls in ("tcp", "tcp,sm", "sm,self,cma", "tcp,cuda_copy", "posix,sysv,tcp", "TCP, sm"):
        for devices in (False, True):
            assert not tls_may_use_rdma(tls, devices)
    for tls in ("rc,tcp", "ib", "ud_verbs,tcp", "dc_mlx5", "srd,tcp"):
        assert tls_may_use_rdma(tls, False)  # named: whatever this host has
    assert tls_may_use_rdma("tcp,some_new_rdma", False)  # a name it does not know counts as RDMA (staged: safe)
    for tls in (None, "", "all", "tcp,all", "^cuda_ipc", "^rc"):
        assert tls_may_use_rdma(tls, True) and not tls_may_use_rdma(tls, False)  # UCX chooses: the host decides


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_tcp_endpoint_reads_unregistered_cpu_sources_only(anyio_backend: str) -> None:
    """(Every endpoint of a process shares one UCX context, so only the tests' ``tls = "tcp"`` opens here; the
    decision for other settings is the unit test above, and the endpoint asks its live context.)"""
    t = await UcxTransport.open(dict(UCX_OPTIONS))
    try:
        assert t.reads_unregistered("cpu") == (UCX_OPTIONS["progress_mode"] in ("blocking", "polling"))
        assert not t.reads_unregistered("cuda:0")
    finally:
        await t.aclose()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_endpoint_that_reads_only_registered_sources_refuses_an_unregistered_one(anyio_backend: str) -> None:
    """As on a host with RDMA (or in a thread progress mode): the write is refused before anything is posted,
    and says nothing can land."""
    a = await UcxTransport.open(dict(UCX_OPTIONS))
    b = await UcxTransport.open(dict(UCX_OPTIONS))
    try:
        a._unregistered_cpu = False
        assert not a.reads_unregistered("cpu")
        dst = torch.zeros(4096, dtype=torch.uint8)
        await b.register([MemoryRegion.of_tensor(dst)])
        link = await a.connect(b.descriptor())
        stray = torch.randint(0, 256, (4096,), dtype=torch.uint8)
        with pytest.raises(TransportError, match="outside every region registered") as info:
            await link.write([WriteOp(stray.data_ptr(), dst.data_ptr(), 4096)])
        assert info.value.may_land is False and int(dst.sum()) == 0
        await link.aclose()
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize(("options", "said"), [
    ({"tsl": "tcp"}, "unknown ucx transport option(s) ['tsl']"),
    ({"tls": "tcp,carrier_pigeon"}, "unknown UCX transport(s) ['carrier_pigeon']"),
    ({"port": 70000}, "transport_options.port must be an integer in [0, 65535]"),
])
def test_check_options_refuses_what_open_refuses_outside_any_event_loop(options: dict[str, Any], said: str) -> None:
    """``aioembed demo`` / ``bench`` check the options before anything runs: no event loop (UCX's open() needs
    asyncio), no UCX context, the same words as ``UcxOptions.parse``."""
    with pytest.raises(ConfigError) as info:
        UcxTransport.check_options(options)
    assert said in str(info.value)
    UcxTransport.check_options(UCX_OPTIONS)
