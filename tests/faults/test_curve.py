"""ZeroMQ CURVE on the control channel: without an allowed key nothing gets through."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import zmq.auth

from aioembed import ConfigError, EmbeddingReceiver, EmbeddingSender, TransferConfig, TransferTimeout

from ..session.conftest import LAYOUT, assert_same, make_request

pytestmark = pytest.mark.anyio


def _keys(tmp_path: Path) -> dict[str, Path]:
    server = tmp_path / "server"
    allowed = tmp_path / "allowed"
    client = tmp_path / "client"
    intruder = tmp_path / "intruder"
    for d in (server, allowed, client, intruder):
        d.mkdir()
    spub, ssec = zmq.auth.create_certificates(server, "server")
    cpub, csec = zmq.auth.create_certificates(client, "client")
    _, isec = zmq.auth.create_certificates(intruder, "intruder")
    (allowed / "client.key").write_bytes(Path(cpub).read_bytes())
    return {"server_secret": Path(ssec), "server_public": Path(spub), "allowed": allowed,
            "client_secret": Path(csec), "intruder_secret": Path(isec)}


async def test_allowed_client_transfers(tmp_path: Path) -> None:
    k = _keys(tmp_path)
    base = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=3.0)
    scfg = base.replace(curve_secret_key_file=str(k["server_secret"]), curve_allowed_clients_dir=str(k["allowed"]))
    rcfg = base.replace(curve_secret_key_file=str(k["client_secret"]),
                        curve_server_public_key_file=str(k["server_public"]))
    async with EmbeddingSender(LAYOUT, scfg) as sender, \
            EmbeddingReceiver(LAYOUT, rcfg, connect=sender.address) as receiver:
        src = make_request(2000, 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(sender.send, "secure", src)
            got = await receiver.receive("secure")
        assert_same(got.tensors, src)


@pytest.mark.parametrize("who", ["intruder", "plaintext"])
async def test_unauthorised_client_gets_nothing_through(tmp_path: Path, who: str) -> None:
    k = _keys(tmp_path)
    base = TransferConfig(default_tokens=1024, pool_tokens=4096, handshake_timeout=0.5, input_timeout=1.0)
    scfg = base.replace(curve_secret_key_file=str(k["server_secret"]), curve_allowed_clients_dir=str(k["allowed"]))
    rcfg = base if who == "plaintext" else base.replace(
        curve_secret_key_file=str(k["intruder_secret"]), curve_server_public_key_file=str(k["server_public"]))
    async with EmbeddingSender(LAYOUT, scfg) as sender, \
            EmbeddingReceiver(LAYOUT, rcfg, connect=sender.address) as receiver:
        with pytest.raises(TransferTimeout) as info:
            await receiver.receive("stolen")
        assert info.value.phase == "handshake"
        assert sender.peers == [] and sender.rooms_in_flight == 0
        # and the sender cannot be made to send to it
        with pytest.raises(TransferTimeout):
            await sender.send("stolen", make_request(10, 2))


def test_curve_settings_are_checked(tmp_path: Path) -> None:
    k = _keys(tmp_path)
    with pytest.raises(ConfigError, match="curve_server_public_key_file"):
        from aioembed.control.sockets import make_dealer

        ctx = zmq.Context()
        try:
            make_dealer(ctx, "tcp://127.0.0.1:1", TransferConfig(curve_secret_key_file=str(k["client_secret"])))
        finally:
            ctx.term()
    with pytest.raises(ConfigError, match="cannot load"):
        from aioembed.control.sockets import make_router

        ctx = zmq.Context()
        try:
            make_router(ctx, "tcp://127.0.0.1:0", TransferConfig(
                curve_secret_key_file=str(tmp_path / "missing"), curve_allowed_clients_dir=str(k["allowed"])))
        finally:
            ctx.term()
