"""Transport options are checked where a config is loaded, and their refusals name where the config came from.

A misspelt ``transport_options`` key was refused only when the endpoint opened (after ``aioembed demo`` printed its
header, inside a server's ``async with EmbeddingSender(...)``), in the plugin's words alone: no file, no variable.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from aioembed import ConfigError, EmbeddingReceiver, EmbeddingSender, TransferConfig, TransportError
from aioembed.samples import standard_layout
from aioembed.transports import Transport, check_transport_options, open_configured
from aioembed.transports import registry as registry_mod
from aioembed.transports.loopback import LoopbackTransport


def _toml(tmp_path: Path, options: str, transport: str = "loopback") -> Path:
    path = tmp_path / "aioembed.toml"
    path.write_text(f'[aioembed]\ntransport = "{transport}"\n\n[aioembed.transport_options]\n{options}\n')
    return path


# -- where a config came from ------------------------------------------------------------------


def test_a_config_knows_where_it_was_read(tmp_path: Path) -> None:
    path = _toml(tmp_path, "threads = 2")
    from_file = TransferConfig.from_toml(path)
    assert from_file.source == f"in {path}"
    env = TransferConfig.from_env({"AIOEMBED_TRANSPORT_OPTIONS": "{threads = 2}"})
    assert env.source == "from the environment: AIOEMBED_TRANSPORT_OPTIONS='{threads = 2}'"
    assert TransferConfig(transport_options={"threads": 2}).source is None  # built in code: the code is the source
    assert TransferConfig.from_mapping({"pool_tokens": 8192}).source is None
    assert TransferConfig.from_env({}).source is None
    # Not a setting: equal settings are equal configs, and the source survives pickling (a config sent to a worker).
    assert from_file == env == TransferConfig(transport_options={"threads": 2})
    assert pickle.loads(pickle.dumps(from_file)).source == f"in {path}"


def test_replace_keeps_the_source_unless_it_replaces_the_options(tmp_path: Path) -> None:
    """The bench replaces pool sizes per workload (and the transport with ``--transport``): the options are still
    the file's. Options given to ``replace()`` are the caller's, not the file's."""
    config = TransferConfig.from_toml(_toml(tmp_path, "threads = 2"))
    assert config.replace(pool_tokens=16384, default_tokens=8192).source == config.source
    assert config.replace(transport="loopback").source == config.source
    assert config.replace(transport_options={"threads": 3}).source is None


# -- the check, before anything opens -------------------------------------------------------------


def test_the_default_check_accepts_anything() -> None:
    """A plugin without a check of its own is checked when it opens, as before."""
    assert Transport.check_options({"anything": object()}) is None


@pytest.mark.parametrize(("options", "said"), [
    ({"threds": 2}, "unknown loopback transport option(s) ['threds']"),
    ({"threads": 0}, "transport_options.threads must be an int in [1, 256], got 0"),
    ({"inline_bytes": "1k"}, "transport_options.inline_bytes must be an int >= 0, got '1k'"),
    ({"unregistered_sources": "yes"}, "transport_options.unregistered_sources must be true or false"),
])
@pytest.mark.anyio
async def test_loopback_checks_what_open_refuses_with_the_same_words(
        anyio_backend: str, options: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigError) as checked:
        LoopbackTransport.check_options(options)
    with pytest.raises(ConfigError) as opened:
        await LoopbackTransport.open(options)
    assert said in str(checked.value) and str(checked.value) == str(opened.value)


def test_loopback_accepts_its_good_options() -> None:
    LoopbackTransport.check_options({})
    LoopbackTransport.check_options({"threads": 1, "inline_bytes": 0, "unregistered_sources": True})


def test_a_refusal_names_the_transport_the_option_and_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'threds = 2')
    with pytest.raises(ConfigError) as info:
        check_transport_options(TransferConfig.from_toml(path))
    msg = str(info.value)
    assert msg.startswith("transport 'loopback' refused its transport_options: unknown loopback transport option(s) "
                          "['threds']")
    assert msg.endswith(f"(in {path})")


def test_a_refusal_names_the_environment_variables() -> None:
    env = {"AIOEMBED_TRANSPORT_OPTIONS": "{threads = 300}", "AIOEMBED_POOL_TOKENS": "16384"}
    with pytest.raises(ConfigError) as info:
        check_transport_options(TransferConfig.from_env(env))
    msg = str(info.value)
    assert "transport 'loopback'" in msg and "transport_options.threads must be an int in [1, 256], got 300" in msg
    assert "AIOEMBED_TRANSPORT_OPTIONS='{threads = 300}'" in msg


def test_a_misspelt_transport_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "threads = 2", transport="loopbak")
    with pytest.raises(ConfigError) as info:
        check_transport_options(TransferConfig.from_toml(path))
    assert "unknown transport 'loopbak'" in str(info.value) and "did you mean 'loopback'?" in str(info.value)
    assert str(info.value).endswith(f"(in {path})")


def test_good_options_and_a_config_in_code_pass_or_fail_without_a_source() -> None:
    check_transport_options(TransferConfig(transport_options={"threads": 2}))
    with pytest.raises(ConfigError) as info:
        check_transport_options(TransferConfig(transport_options={"threds": 2}))
    assert str(info.value).endswith("known: ['inline_bytes', 'threads', 'unregistered_sources']")


class _BuggyCheck(LoopbackTransport):
    name = "buggy-check"

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        raise KeyError("engine table")


def test_a_check_that_fails_otherwise_is_a_transport_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """As at every plugin call: a plugin's own exception reaches the caller as ``TransportError``, its cause kept."""
    monkeypatch.setattr(registry_mod, "_builtin", lambda: {"buggy-check": _BuggyCheck})
    with pytest.raises(TransportError, match=r"transport 'buggy-check': check_options\(\) raised KeyError") as info:
        check_transport_options(TransferConfig(transport="buggy-check"))
    assert isinstance(info.value.__cause__, KeyError)


# -- the refusal at open, inside the sessions ---------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("side", ["sender", "receiver"])
async def test_a_session_opening_the_transport_names_the_file(anyio_backend: str, tmp_path: Path, side: str) -> None:
    """A server that never runs the check is told at ``async with`` where the refused options came from."""
    path = _toml(tmp_path, "threds = 2")
    config = TransferConfig.from_toml(path, pool_tokens=8192, default_tokens=1024)
    layout = standard_layout(8)
    session = (EmbeddingSender(layout, config, bind="tcp://127.0.0.1:0") if side == "sender" else
               EmbeddingReceiver(layout, config, connect="tcp://127.0.0.1:9"))
    with pytest.raises(ConfigError) as info:
        async with session:
            pass
    msg = str(info.value)
    assert "unknown loopback transport option(s) ['threds']" in msg and msg.endswith(f"(in {path})")
    assert msg.count(str(path)) == 1


class _NamesItsSource(LoopbackTransport):
    name = "names-its-source"

    @classmethod
    async def open(cls, options: Mapping[str, Any]) -> _NamesItsSource:
        raise ConfigError("transport_options.x is wrong (in cfg.yaml)")


@pytest.mark.anyio
async def test_a_refusal_that_names_the_source_already_is_left_as_it_is(
        anyio_backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_mod, "_builtin", lambda: {"names-its-source": _NamesItsSource})
    config = TransferConfig.from_mapping({"transport": "names-its-source"}, source="cfg.yaml")
    assert config.source == "in cfg.yaml"
    with pytest.raises(ConfigError) as info:
        await open_configured(config)
    assert str(info.value) == "transport_options.x is wrong (in cfg.yaml)"
