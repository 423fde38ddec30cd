"""Options are validated with clear errors; the plugin is found by name; import failures explain the fix."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from aioembed import TransferConfig
from aioembed.errors import ConfigError, TransportError
from aioembed.transports.registry import available_transports, resolve_transport

import aioembed_mooncake._engine as engine_mod
from aioembed_mooncake import MooncakeTransport
from aioembed_mooncake._engine import rdma_devices
from aioembed_mooncake.transport import _Config, default_hostname

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_entry_point_resolves() -> None:
    assert "mooncake" in available_transports()
    assert resolve_transport("mooncake") is MooncakeTransport
    caps = MooncakeTransport.capabilities
    assert caps.cross_process and not caps.asyncio_only


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"protocol": "udp"}, "protocol"),
        pytest.param({"protocol": "rdma"}, "no RDMA device",
                     marks=pytest.mark.skipif(bool(rdma_devices()), reason="this host has RDMA devices")),
        ({"device_name": "mlx5_9"}, "device_name"),
        ({"device_name": 3}, "device_name"),
        ({"hostname": "10.0.0.1:1234"}, "without a port"),
        ({"hostname": ""}, "hostname"),
        ({"metadata_server": "p2phandshake"}, "P2PHANDSHAKE"),
        ({"threads": 0}, "threads"),
        ({"threads": True}, "threads"),
        ({"max_batch_bytes": 10}, "max_batch_bytes"),
        ({"max_batch_ops": 0}, "max_batch_ops"),
        ({"transfer_timeout": 1}, "at least|minimum"),
        ({"transfer_timeout": "30"}, "transfer_timeout"),
        ({"bogus": 1}, "unknown mooncake transport option"),
    ],
)
async def test_bad_options(options: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        await MooncakeTransport.open(options)


def test_defaults() -> None:
    cfg = _Config({})
    assert cfg.protocol == ("rdma" if rdma_devices() else "tcp")  # auto
    assert cfg.metadata_server == "P2PHANDSHAKE"
    assert cfg.threads == 4 and cfg.max_batch_ops == 256 and cfg.max_batch_bytes == 16 << 20
    assert cfg.transfer_timeout is None
    assert cfg.hostname == default_hostname()
    assert _Config({"transfer_timeout": 7.2}).transfer_timeout == 8
    assert _Config({"device_name": "mlx5_0", "protocol": "tcp"}).device_name == ""  # ignored for tcp


def test_options_through_transfer_config_toml(tmp_path: Any) -> None:
    p = tmp_path / "aioembed.toml"
    p.write_text('[aioembed]\ntransport = "mooncake"\ntransport_options = { protocol = "tcp", threads = 2 }\n')
    cfg = TransferConfig.from_toml(p)
    assert cfg.transport == "mooncake" and _Config(cfg.transport_options).threads == 2


async def test_import_failure_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def fail(name: str, *a: Any, **k: Any) -> Any:
        if name == "mooncake.engine":
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
        return real(name, *a, **k)

    monkeypatch.setattr(engine_mod, "_loaded", [])
    monkeypatch.setattr(engine_mod.importlib, "import_module", fail)
    with pytest.raises(TransportError) as err:
        await MooncakeTransport.open({"protocol": "tcp"})
    msg = str(err.value)
    assert "aioembed-mooncake[non-cuda]" in msg and "apt-get install -y libibverbs1" in msg and "libibverbs" in msg


async def test_too_old_engine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_mod, "_loaded", [])
    monkeypatch.setattr(engine_mod, "installed_engine", lambda: ("mooncake-transfer-engine-non-cuda", "0.3.10.post1"))
    with pytest.raises(TransportError, match=r"too old.*0\.3\.12"):
        await MooncakeTransport.open({"protocol": "tcp"})


async def test_protocol_mismatch_and_closed_endpoint() -> None:
    async with await MooncakeTransport.open({"protocol": "tcp", "hostname": "127.0.0.1"}) as a:
        import msgpack

        desc = msgpack.unpackb(a.descriptor())
        desc["protocol"] = "rdma"
        with pytest.raises(TransportError, match="protocol"):
            await a.connect(msgpack.packb(desc))
        desc["protocol"], desc["session"] = "tcp", "127.0.0.1:1"
        with pytest.raises(TransportError, match="not reachable"):
            await a.connect(msgpack.packb(desc))
    with pytest.raises(TransportError, match="closed"):
        a.descriptor()


@pytest.mark.parametrize(("options", "said"), [
    ({"protocl": "tcp"}, "unknown mooncake transport option(s) ['protocl']"),
    ({"protocol": "udp"}, "transport_options.protocol='udp'"),
    ({"threads": 0}, "transport_options.threads must be an integer in [1, 256], got 0"),
])
def test_check_options_refuses_what_open_refuses_without_an_engine(
        options: dict[str, Any], said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``aioembed demo`` / ``bench`` check the options before anything runs; the engine is not loaded for it."""
    monkeypatch.setattr(engine_mod, "_loaded", [])
    monkeypatch.setattr(engine_mod, "load_engine_module", lambda: pytest.fail("the check loaded the engine"))
    with pytest.raises(ConfigError) as info:
        MooncakeTransport.check_options(options)
    assert said in str(info.value)
    MooncakeTransport.check_options({"protocol": "tcp", "threads": 2, "hostname": "127.0.0.1"})


@pytest.mark.parametrize(("options", "expected"), [
    ({"protocol": "auto"}, ["protocol 'auto' chose", "advertising hostname"]),
    ({"protocol": "tcp", "device_name": "mlx5_0", "hostname": "127.0.0.1"}, ["is ignored with protocol 'tcp'"]),
])
def test_a_check_ahead_of_open_says_its_choices_once(options: dict[str, Any], expected: list[str],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """``aioembed demo``/``bench`` check the options, then open: the choices made for unset options (protocol
    'auto', the advertised hostname) and an ignored ``device_name`` were logged by both, each line twice."""
    with caplog.at_level("INFO", logger="aioembed_mooncake"):
        MooncakeTransport.check_options(options)
    assert [r.getMessage() for r in caplog.records] == []
    with caplog.at_level("INFO", logger="aioembed_mooncake"):
        _Config(options)
    said = [r.getMessage() for r in caplog.records]
    for words in expected:
        assert sum(words in m for m in said) == 1, said
