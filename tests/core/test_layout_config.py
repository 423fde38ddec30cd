"""Layout (fields, fingerprint, validation) and TransferConfig (values, env, TOML)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from aioembed import ConfigError, Field, Layout, LayoutError, TransferConfig


def std_layout() -> Layout:
    return Layout(
        embeddings=Field((64,), torch.bfloat16),
        token_ids=Field((), torch.int32),
        mrope_positions=Field((3,), torch.int64),
    )


# -- Field ------------------------------------------------------------------------------------


def test_field_sizes() -> None:
    assert Field((3584,), torch.bfloat16).row_bytes == 7168
    assert Field((), torch.int32).row_elements == 1
    assert Field((), torch.int32).row_bytes == 4
    assert Field((3,), torch.int64).row_bytes == 24
    assert Field((2, 5), torch.float32).row_elements == 10
    f = Field([4, 2], torch.float16)  # type: ignore[arg-type]
    assert f.shape == (4, 2) and isinstance(f.shape, tuple)


@pytest.mark.parametrize("shape", [(0,), (-1,), (True,), (2.0,), ("3",), (3, 0)])
def test_field_bad_shape(shape: tuple[Any, ...]) -> None:
    with pytest.raises(LayoutError, match="shape"):
        Field(shape, torch.float32)


@pytest.mark.parametrize("dtype", ["float32", float, None, 4])
def test_field_bad_dtype(dtype: Any) -> None:
    with pytest.raises(LayoutError, match="dtype"):
        Field((1,), dtype)


# -- Layout -----------------------------------------------------------------------------------


def test_layout_mapping_and_sizes() -> None:
    lay = std_layout()
    assert list(lay) == ["embeddings", "token_ids", "mrope_positions"]
    assert len(lay) == 3
    assert lay["token_ids"] == Field((), torch.int32)
    assert lay.bytes_per_token == 64 * 2 + 4 + 3 * 8
    assert "Layout(" in repr(lay) and "embeddings" in repr(lay)
    with pytest.raises(KeyError):
        lay["nope"]


def test_layout_construction_errors() -> None:
    with pytest.raises(LayoutError, match="at least one"):
        Layout()
    with pytest.raises(LayoutError, match="'x'"):
        Layout(x=(4,))  # type: ignore[arg-type]


def test_fingerprint_stable() -> None:
    a, b = std_layout(), std_layout()
    assert a.fingerprint == b.fingerprint
    assert a == b and hash(a) == hash(b)
    assert a.fingerprint.startswith("v1-") and len(a.fingerprint) == 3 + 32
    int(a.fingerprint[3:], 16)
    # pinned: a changed digest would make old and new peers refuse each other
    assert a.fingerprint == Layout(
        embeddings=Field((64,), torch.bfloat16),
        token_ids=Field((), torch.int32),
        mrope_positions=Field((3,), torch.int64),
    ).fingerprint
    assert Layout(x=Field((64,), torch.bfloat16), ids=Field((), torch.int32),
                  pos=Field((3,), torch.int64)).fingerprint == "v1-6a2690d576df365e86d994c882687bab"


@pytest.mark.parametrize(
    "other",
    [
        Layout(token_ids=Field((), torch.int32), embeddings=Field((64,), torch.bfloat16),
               mrope_positions=Field((3,), torch.int64)),  # order
        Layout(embeddings=Field((64,), torch.float16), token_ids=Field((), torch.int32),
               mrope_positions=Field((3,), torch.int64)),  # dtype
        Layout(embeddings=Field((64,), torch.bfloat16), token_ids=Field((), torch.int64),
               mrope_positions=Field((3,), torch.int64)),  # dtype of a scalar
        Layout(embeddings=Field((32,), torch.bfloat16), token_ids=Field((), torch.int32),
               mrope_positions=Field((3,), torch.int64)),  # shape
        Layout(embeddings=Field((64, 1), torch.bfloat16), token_ids=Field((), torch.int32),
               mrope_positions=Field((3,), torch.int64)),  # rank of shape
        Layout(embeddings=Field((64,), torch.bfloat16), token_ids=Field((1,), torch.int32),
               mrope_positions=Field((3,), torch.int64)),  # scalar vs (1,)
        Layout(embedding=Field((64,), torch.bfloat16), token_ids=Field((), torch.int32),
               mrope_positions=Field((3,), torch.int64)),  # name
        Layout(embeddings=Field((64,), torch.bfloat16), token_ids=Field((), torch.int32)),  # missing field
    ],
)
def test_fingerprint_sensitive(other: Layout) -> None:
    assert other.fingerprint != std_layout().fingerprint
    assert other != std_layout()


def test_fingerprint_no_collision_through_separators_in_names() -> None:
    """Names that could forge another layout's fingerprint string are refused outright."""
    Layout(**{"a": Field((1,), torch.int32), "b": Field((2,), torch.int64)})
    for bad in ("a:1:int32;b", "x;y", "", "1st", "has space"):
        with pytest.raises(LayoutError, match="identifier"):
            Layout(**{bad: Field((2,), torch.int64)})


def test_validate_ok_and_empty() -> None:
    lay = std_layout()
    t = lay.empty(7)
    assert t["embeddings"].shape == (7, 64) and t["embeddings"].dtype == torch.bfloat16
    assert t["token_ids"].shape == (7,) and t["mrope_positions"].shape == (7, 3)
    assert lay.validate(t) == 7
    assert lay.validate(lay.empty(0)) == 0


def _tensors(**changes: Any) -> dict[str, Any]:
    t: dict[str, Any] = std_layout().empty(5)
    for k, v in changes.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    return t


@pytest.mark.parametrize(
    ("tensors", "fragments"),
    [
        (_tensors(token_ids=None), ["missing", "token_ids"]),
        (_tensors(extra=torch.zeros(5)), ["unexpected", "extra"]),
        (_tensors(embeddings=torch.zeros(5, 64, dtype=torch.float32)), ["embeddings", "dtype", "float32"]),
        (_tensors(token_ids=torch.zeros(5, dtype=torch.int64)), ["token_ids", "int32", "int64"]),
        (_tensors(mrope_positions=torch.zeros(5, 4, dtype=torch.int64)), ["mrope_positions", "shape"]),
        (_tensors(token_ids=torch.zeros(5, 1, dtype=torch.int32)), ["token_ids", "shape"]),
        (_tensors(embeddings=torch.zeros(64, dtype=torch.bfloat16)), ["embeddings", "shape"]),
        (_tensors(mrope_positions=torch.zeros(6, 3, dtype=torch.int64)), ["mrope_positions", "6", "5"]),
        (_tensors(token_ids=[1, 2, 3]), ["token_ids", "Tensor"]),
        # a sparse tensor escaped as torch's RuntimeError later (and leaked the sender's staged rows)
        (_tensors(token_ids=torch.zeros(5, dtype=torch.int32).to_sparse()), ["token_ids", "dense", "sparse"]),
    ],
)
def test_validate_errors_name_the_field(tensors: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(LayoutError) as info:
        std_layout().validate(tensors)
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))


# -- TransferConfig ---------------------------------------------------------------------------


def test_config_defaults() -> None:
    c = TransferConfig()
    assert c.transport == "loopback"
    assert dict(c.transport_options) == {}
    assert (c.block_size, c.default_tokens, c.pool_tokens) == (128, 8192, 65536)
    assert c.max_round_tokens is None and c.round_tokens == 65536
    assert c.pool_blocks == 512
    assert c.max_request_tokens == 1 << 22
    assert (c.handshake_timeout, c.input_timeout, c.round_timeout, c.room_timeout) == (10.0, 60.0, 30.0, 600.0)
    assert (c.heartbeat_interval, c.heartbeat_misses) == (1.0, 5)
    assert c.device == "cpu" and c.copy_threads == 4


def test_config_valid_variants() -> None:
    c = TransferConfig(block_size=16, default_tokens=32, pool_tokens=64, max_round_tokens=48, device="cuda:1",
                       transport_options={"protocol": "tcp"}, round_timeout=0.5, heartbeat_interval=86400)
    assert c.round_tokens == 48 and c.pool_blocks == 4
    assert c.transport_options["protocol"] == "tcp"
    with pytest.raises(TypeError):
        c.transport_options["x"] = 1  # type: ignore[index]
    with pytest.raises(AttributeError):
        c.block_size = 4  # type: ignore[misc]
    assert TransferConfig(device="cuda").device == "cuda"
    assert TransferConfig(default_tokens=65536).default_tokens == 65536


def test_config_options_copied() -> None:
    opts = {"a": 1}
    c = TransferConfig(transport_options=opts)
    opts["a"] = 2
    assert c.transport_options["a"] == 1


BAD_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"default_tokens": 100}, "default_tokens"),
    ({"default_tokens": 8200}, "default_tokens"),
    ({"pool_tokens": 65537}, "pool_tokens"),
    ({"max_round_tokens": 1000}, "max_round_tokens"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": -128}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"block_size": 128.0}, "block_size"),
    ({"block_size": "128"}, "block_size"),
    ({"default_tokens": 0}, "default_tokens"),
    ({"default_tokens": False}, "default_tokens"),
    ({"pool_tokens": 4096}, "pool_tokens"),  # smaller than default_tokens
    ({"max_round_tokens": 65536 * 2}, "pool_tokens"),  # pool smaller than a round
    ({"max_round_tokens": 0}, "max_round_tokens"),
    ({"max_round_tokens": True}, "max_round_tokens"),
    ({"max_request_tokens": 0}, "max_request_tokens"),
    ({"max_request_tokens": (1 << 40) + 1}, "max_request_tokens"),
    ({"max_metadata_bytes": -1}, "max_metadata_bytes"),
    ({"max_rooms_per_peer": 0}, "max_rooms_per_peer"),
    ({"max_concurrent_handshakes": 0}, "max_concurrent_handshakes"),
    ({"max_concurrent_handshakes": True}, "max_concurrent_handshakes"),
    ({"heartbeat_misses": 0}, "heartbeat_misses"),
    ({"heartbeat_misses": True}, "heartbeat_misses"),
    ({"copy_threads": 0}, "copy_threads"),
    ({"copy_threads": 2.5}, "copy_threads"),
    ({"transport": ""}, "transport"),
    ({"transport": 5}, "transport"),
    ({"transport": None}, "transport"),
    ({"device": "gpu"}, "device"),
    ({"device": "CPU"}, "device"),
    ({"device": ""}, "device"),
    ({"curve_secret_key_file": ""}, "curve_secret_key_file"),
    ({"curve_server_public_key_file": 3}, "curve_server_public_key_file"),
    ({"curve_allowed_clients_dir": ""}, "curve_allowed_clients_dir"),
]
for _name in ("handshake_timeout", "input_timeout", "round_timeout", "room_timeout", "heartbeat_interval"):
    BAD_VALUES += [
        ({_name: -1}, _name), ({_name: -0.001}, _name), ({_name: 0}, _name), ({_name: math.nan}, _name),
        ({_name: math.inf}, _name), ({_name: 86401}, _name), ({_name: True}, _name), ({_name: "5"}, _name),
        ({_name: None}, _name),
    ]


BAD_VALUES += [({"heartbeat_interval": v}, "heartbeat_interval") for v in (1e-300, 0.009)]  # a PING storm


@pytest.mark.parametrize(("kwargs", "name"), BAD_VALUES, ids=[f"{k}" for k, _ in BAD_VALUES])
def test_config_bad_values(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig(**kwargs)
    assert name in str(info.value)
    assert isinstance(info.value, ValueError)


def test_config_multiple_message_suggests_value() -> None:
    with pytest.raises(ConfigError, match=r"default_tokens=100 must be a multiple of block_size=128 \(e.g. 128\)"):
        TransferConfig(default_tokens=100)


def test_config_replace_validates() -> None:
    c = TransferConfig()
    c2 = c.replace(round_timeout=2.0)
    assert c2.round_timeout == 2.0 and c.round_timeout == 30.0
    with pytest.raises(ConfigError, match="round_timeout"):
        c.replace(round_timeout=-2)
    with pytest.raises(ConfigError, match="default_tokens"):
        c.replace(block_size=3)


@pytest.mark.parametrize("value", [5, "protocol=tcp", [("protocol", "tcp")], None])
def test_config_transport_options_must_be_mapping(value: Any) -> None:
    with pytest.raises(ConfigError, match="transport_options"):
        TransferConfig(transport_options=value)


@pytest.mark.parametrize("device", ["cuda:", "cuda:x", "cuda:-1"])
def test_config_device_index_checked(device: str) -> None:
    with pytest.raises(ConfigError, match="device"):
        TransferConfig(device=device)


def test_from_mapping_unknown_keys() -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_mapping({"blok_size": 4, "block_size": 128}, source="test")
    msg = str(info.value)
    assert "blok_size" in msg and "test" in msg and "block_size" in msg
    assert TransferConfig.from_mapping({"block_size": 64}).block_size == 64


# -- from_env ---------------------------------------------------------------------------------


def test_from_env_values() -> None:
    env = {
        "AIOEMBED_DEFAULT_TOKENS": "4096",
        "AIOEMBED_TRANSPORT_OPTIONS": '{protocol = "tcp", device_name = "mlx5_0", threads = 3}',
        "AIOEMBED_ROUND_TIMEOUT": "2.5",
        "AIOEMBED_MAX_ROUND_TOKENS": "none",
        "AIOEMBED_DEVICE": "cuda:0",
        "AIOEMBED_CURVE_SECRET_KEY_FILE": "/keys/a.key_secret",
        "AIOEMBED_TRANSPORT": "mooncake",
        "OTHER_DEFAULT_TOKENS": "1",
    }
    c = TransferConfig.from_env(env)
    assert c.default_tokens == 4096
    assert dict(c.transport_options) == {"protocol": "tcp", "device_name": "mlx5_0", "threads": 3}
    assert c.round_timeout == 2.5
    assert c.max_round_tokens is None
    assert c.device == "cuda:0"
    assert c.curve_secret_key_file == "/keys/a.key_secret"
    assert c.transport == "mooncake"
    assert c.block_size == 128  # not set: default


def test_from_env_overrides_win() -> None:
    env = {"AIOEMBED_DEFAULT_TOKENS": "4096", "AIOEMBED_BLOCK_SIZE": "64"}
    c = TransferConfig.from_env(env, default_tokens=1024)
    assert c.default_tokens == 1024 and c.block_size == 64


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOEMBED_POOL_TOKENS", "131072")
    monkeypatch.setenv("AIOEMBED_MAX_ROUND_TOKENS", "16384")
    c = TransferConfig.from_env()
    assert c.pool_tokens == 131072 and c.round_tokens == 16384


@pytest.mark.parametrize(
    ("key", "raw"),
    [
        ("AIOEMBED_DEFAULT_TOKENS", "lots"),
        ("AIOEMBED_DEFAULT_TOKENS", "4096.0"),
        ("AIOEMBED_BLOCK_SIZE", "true"),
        ("AIOEMBED_ROUND_TIMEOUT", "soon"),
        ("AIOEMBED_TRANSPORT_OPTIONS", "{protocol = }"),
        ("AIOEMBED_TRANSPORT_OPTIONS", "protocol=tcp"),
    ],
)
def test_from_env_unparsable(key: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_env({key: raw})
    assert key in str(info.value)


@pytest.mark.parametrize(
    ("key", "raw", "name"),
    [
        ("AIOEMBED_DEFAULT_TOKENS", "100", "default_tokens"),
        ("AIOEMBED_ROUND_TIMEOUT", "-1", "round_timeout"),
        ("AIOEMBED_ROUND_TIMEOUT", "nan", "round_timeout"),
        ("AIOEMBED_BLOCK_SIZE", "none", "block_size"),
        ("AIOEMBED_TRANSPORT", "", "transport"),
    ],
)
def test_from_env_out_of_range(key: str, raw: str, name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        TransferConfig.from_env({key: raw})


# -- from_toml --------------------------------------------------------------------------------


def test_from_toml_with_table(tmp_path: Path) -> None:
    p = tmp_path / "server.toml"
    p.write_text(
        'title = "not ours"\n'
        "[aioembed]\n"
        'transport = "ucx"\n'
        "block_size = 64\n"
        "default_tokens = 4096\n"
        "round_timeout = 12.5\n"
        "[aioembed.transport_options]\n"
        'protocol = "rdma"\n'
        "[other]\n"
        "x = 1\n"
    )
    c = TransferConfig.from_toml(p)
    assert c.transport == "ucx" and c.block_size == 64 and c.default_tokens == 4096 and c.round_timeout == 12.5
    assert dict(c.transport_options) == {"protocol": "rdma"}
    c2 = TransferConfig.from_toml(str(p), default_tokens=2048)
    assert c2.default_tokens == 2048


def test_from_toml_top_level(tmp_path: Path) -> None:
    p = tmp_path / "aioembed.toml"
    p.write_text("pool_tokens = 16384\ndefault_tokens = 8192\ntransport_options = { threads = 2 }\n")
    c = TransferConfig.from_toml(p)
    assert c.pool_tokens == 16384 and dict(c.transport_options) == {"threads": 2}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[aioembed]\nblok_size = 64\n", "blok_size"),
        ("[aioembed]\nblock_size = \"64\"\n", "block_size"),
        ("[aioembed]\nblock_size = true\n", "block_size"),
        ("[aioembed]\nround_timeout = -3\n", "round_timeout"),
        ("[aioembed]\ndefault_tokens = 100\n", "default_tokens"),
        ("aioembed = 5\n", "table"),
        ("[aioembed\nblock_size = 1\n", "TOML"),
        ("block_size = 64\n[other]\nx = 1\n", "other"),
        # a setting outside the table when there is one was silently dropped
        ("block_size = 256\n[aioembed]\npool_tokens = 4096\n", "outside its [aioembed] table"),
        ("block_size = 256\n[aioembed.transport_options]\nprotocol = 'tcp'\n", "outside its [aioembed] table"),
    ],
)
def test_from_toml_errors(tmp_path: Path, text: str, fragment: str) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_toml(p)
    assert fragment in str(info.value)


def test_from_toml_not_utf8(tmp_path: Path) -> None:
    p = tmp_path / "utf16.toml"
    p.write_bytes("[aioembed]\nblock_size = 64\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"cannot read TOML config .*utf16\.toml"):
        TransferConfig.from_toml(p)


def test_config_is_a_value_that_pickles_copies_and_hashes() -> None:
    """A config goes to spawned worker processes (pickled) and through dataclasses.asdict; its transport
    options stay read-only."""
    c = TransferConfig(transport="mooncake", transport_options={"protocol": "tcp", "lanes": [1, 2]})
    for copied in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c), copy.copy(c)):
        assert copied == c and hash(copied) == hash(c)
        assert dict(copied.transport_options) == {"protocol": "tcp", "lanes": [1, 2]}
    assert dataclasses.asdict(c)["transport_options"] == {"protocol": "tcp", "lanes": [1, 2]}
    with pytest.raises(TypeError, match="read-only"):
        c.transport_options["protocol"] = "rdma"  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        c.transport_options.update(protocol="rdma")  # type: ignore[attr-defined]


@pytest.mark.parametrize("half", [{"curve_allowed_clients_dir": "/keys"}, {"curve_server_public_key_file": "/k.pub"}])
def test_curve_without_a_secret_key_is_refused(half: dict[str, str]) -> None:
    """CURVE is on only with this side's secret key: the other half alone left the sender unauthenticated."""
    with pytest.raises(ConfigError, match="curve_secret_key_file is not: CURVE authentication would be off"):
        TransferConfig(**half)


def test_a_reservation_must_fit_one_control_message() -> None:
    with pytest.raises(ConfigError, match="more than one control message carries"):
        TransferConfig(block_size=1, default_tokens=1 << 21, pool_tokens=1 << 22)
    TransferConfig(block_size=1, default_tokens=1 << 20, pool_tokens=1 << 22, max_round_tokens=1 << 20)


def test_from_toml_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        TransferConfig.from_toml(tmp_path / "nope.toml")


def test_from_toml_unknown_key_names_file(tmp_path: Path) -> None:
    p = tmp_path / "x.toml"
    p.write_text("[aioembed]\nspeed = 9\n")
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_toml(p)
    assert str(p) in str(info.value) and "speed" in str(info.value)


def test_a_bad_value_names_the_file_it_came_from(tmp_path: Path) -> None:
    """Unknown names named the file, bad values did not: a server reading one of several config files (or
    containers setting some AIOEMBED_* variables) was told ``pool_tokens=100 must be a multiple of block_size=128``
    with no word of where that 100 was written."""
    p = tmp_path / "language.toml"
    p.write_text("[aioembed]\npool_tokens = 100\n")
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_toml(p)
    assert "pool_tokens=100 must be a multiple of block_size=128" in str(info.value)
    assert f"(in {p})" in str(info.value)


def test_a_bad_value_from_the_environment_names_the_variables_read() -> None:
    env = {"AIOEMBED_POOL_TOKENS": "4096", "AIOEMBED_DEFAULT_TOKENS": "8192", "AIOEMBED_ROOM_TIMEOUT": "9"}
    with pytest.raises(ConfigError) as info:
        TransferConfig.from_env(env)
    msg = str(info.value)
    assert "default_tokens=8192 exceeds pool_tokens=4096" in msg
    assert ("(from the environment: AIOEMBED_DEFAULT_TOKENS='8192', AIOEMBED_POOL_TOKENS='4096', "
            "AIOEMBED_ROOM_TIMEOUT='9')") in msg


def test_staging_max_tokens_must_fit_the_staging_area() -> None:
    """It was clamped to staging_tokens without a word: requests up to the setting were not all staged."""
    with pytest.raises(ConfigError, match="staging_max_tokens=512 exceeds staging_tokens=256"):
        TransferConfig(staging_tokens=256, staging_max_tokens=512)
    TransferConfig(staging_tokens=256, staging_max_tokens=256)
    TransferConfig(staging_tokens=0, staging_max_tokens=512)  # no staging area: nothing to fit


def test_unknown_settings_are_config_errors_everywhere() -> None:
    """The constructor and replace() raised Python's TypeError (only from_mapping said ConfigError)."""
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['defualt_tokens'\]; known settings: \["):
        TransferConfig().replace(defualt_tokens=64)
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['bogus'\]"):
        TransferConfig(bogus=1)
    with pytest.raises(ConfigError, match="takes settings by name"):
        TransferConfig("loopback")  # type: ignore[misc]
    c = TransferConfig(pool_tokens=8192)
    assert pickle.loads(pickle.dumps(c)) == c and copy.deepcopy(c) == c and copy.copy(c) == c


def test_contradictory_timeouts_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Valid (the earlier deadline wins) but not what was meant: said once per process and combination."""
    with caplog.at_level(logging.WARNING, logger="aioembed.config"):
        TransferConfig(room_timeout=7.25, input_timeout=9.0, round_timeout=5.0, heartbeat_interval=2.0,
                       heartbeat_misses=4)
        TransferConfig(room_timeout=7.25, input_timeout=9.0, round_timeout=5.0, heartbeat_interval=2.0,
                       heartbeat_misses=4)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "input_timeout=9.0 s exceeds room_timeout=7.25 s" in said[0]
    assert "= 8.0 s of silence before a peer is declared dead is not less than room_timeout=7.25 s" in said[1]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aioembed.config"):
        TransferConfig()
    assert not caplog.records
