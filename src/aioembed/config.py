"""Transfer settings: built from keyword arguments, environment variables or a TOML file.

Every value is checked at construction, so a bad setting fails where it is written, with
the setting's name and its allowed range, not minutes later inside a transfer.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aioembed.errors import ConfigError
from aioembed.protocol.messages import (
    MAX_BLOCK_SIZE,
    MAX_BLOCKS_PER_MESSAGE,
    MAX_INLINE_BYTES,
    MAX_METADATA_BYTES,
    MAX_POOL_BLOCKS,
)

__all__ = ["ENV_PREFIX", "TransferConfig"]

ENV_PREFIX = "AIOEMBED_"

log = logging.getLogger(__name__)

_MAX_INT = 1 << 40
_WARNED: set[str] = set()  # contradictory-timeout warnings already logged (see _warn_contradictory_timeouts)


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """Settings shared by :class:`~aioembed.EmbeddingSender` and :class:`~aioembed.EmbeddingReceiver`.

    Token counts are in tokens (rows); times are in seconds. ``transport_options`` is passed
    to the transport plugin unchanged; the plugin validates it.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> TransferConfig:
        # Before the dataclass's __init__, whose TypeError for a misspelt setting would be the one error of a
        # bad configuration outside AioembedError. (Unpickling and copying call this with no arguments.)
        if args:
            raise ConfigError(f"TransferConfig takes settings by name (e.g. TransferConfig(pool_tokens=...)), "
                              f"got {len(args)} positional argument(s)")
        _check_names(kwargs, "")
        return super().__new__(cls)

    transport: str = "loopback"
    """Name of the transport: ``loopback`` (built in) or a plugin from ``aioembed.transports``."""
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    """Options for the transport plugin (e.g. ``{"protocol": "tcp"}`` for Mooncake)."""
    block_size: int = 128
    """Tokens per block of the receive pool."""
    default_tokens: int = 8192
    """Tokens reserved for a room whose length the receiver does not know yet."""
    pool_tokens: int = 65536
    """Size of the receiver's registered pool, in tokens."""
    max_round_tokens: int | None = None
    """Most tokens reserved for one resume round (default: the whole pool)."""
    resume_reserve_tokens: int | None = None
    """Slice of the pool that first reservations may not use, so rooms already transferring can
    always resume even when every other block is reserved by rooms still waiting for input
    (default: an eighth of the pool, at most ``pool_tokens - default_tokens``)."""
    max_request_tokens: int = 1 << 22
    """Largest request a receiver accepts, in tokens."""
    max_metadata_bytes: int = 65536
    """Largest per-request metadata record, msgpack-encoded."""
    max_rooms_per_peer: int = 4096
    """Most rooms one peer may have open at once on a sender."""
    staging_tokens: int = 4096
    """Sender: rows of each field in its staging area, registered once at start (0: none). Requests of
    at most ``staging_max_tokens`` are copied there instead of registering the caller's tensors for
    each ``send()`` (for small requests a copy costs less than a registration)."""
    staging_max_tokens: int = 256
    """Sender: the largest request (in tokens) copied into the staging area."""
    status_inline_bytes: int = 8192
    """Receiver: the most bytes of a round's rows it takes inside the round's STATUS frame instead of a
    transport write (a CPU pool only; 0: none). The sender carries a round's smaller CPU fields there (token
    ids, positions: a few bytes per token) while they fit, and keeps a write for the rest (at least the largest
    field): each field would otherwise cost a write op of its own, which for small requests costs more than its
    bytes."""
    stream_chunk_tokens: int = 2048
    """Streaming receive: the sender announces rows within a round every this many tokens (rounded up
    to whole blocks), so chunks reach the caller before the round ends; 0: only at round ends."""
    copy_chunk_tokens: int = 4096
    """Copying receive (``receive()``, ``out=``): the sender announces rows within a round every this many
    tokens (rounded up to whole blocks), and the receiver copies each chunk out while the next ones are
    still being written, so the copy overlaps the transfer instead of following it (rows announced while
    a chunk is copied join that copy; a CPU pool copies a round's end over ``copy_threads``); 0: copy
    each round once it has landed. Not for copies that stay on the GPU (a CUDA pool into CUDA memory):
    those copy each round once it has landed (a device copy is much faster than the writes, so chunks
    would only add per-write costs); a CUDA pool's ``out=`` on the CPU is still copied chunk by chunk."""
    output_cache_bytes: int = 256 << 20
    """Receiver: memory of ``receive()`` outputs the caller has dropped, kept (up to this many bytes)
    for the next outputs, which then skip the page faults of new memory. Only fields of at least 64 KiB
    are kept; 0: none."""
    max_senders: int = 64
    """Most senders one receiver keeps a connection to (idle ones are closed to make room)."""
    sender_idle_timeout: float = 300.0
    """Seconds a receiver keeps a connection to a sender with no room in flight (and no blocks it
    may still write) before closing it."""
    handshake_timeout: float = 10.0
    """Seconds for the HELLO / WELCOME handshake."""
    max_concurrent_handshakes: int = 64
    """Sender: most handshakes (transport connects to receivers) in progress at once. A HELLO beyond them is
    answered ``REJECT(busy)`` at once and the receiver says HELLO again after its back-off: a burst of receivers
    (a cluster restarting, or a peer inventing receiver ids) holds at most this many connects, not one each."""
    input_timeout: float = 60.0
    """Seconds a receiver waits for the first data of a room, and a sender for the receivers' INIT."""
    round_timeout: float = 30.0
    """Seconds for one resume round (free blocks, RESUME, write, STATUS). The sender waits a second
    longer for a RESUME, so the receiver, which knows why a round is late, reports first."""
    room_timeout: float = 600.0
    """Hard deadline for a whole room, whatever happens."""
    heartbeat_interval: float = 1.0
    """Seconds between PINGs to each peer."""
    heartbeat_misses: int = 5
    """Intervals of silence after which a peer is declared dead."""
    device: str = "cpu"
    """Device of the receive pool: ``cpu`` or ``cuda[:N]``."""
    copy_threads: int = 4
    """Worker threads for large copies and blocking transport calls."""
    curve_secret_key_file: str | None = None
    """ZeroMQ CURVE: this side's secret key file (enables authentication)."""
    curve_server_public_key_file: str | None = None
    """ZeroMQ CURVE, receiver side: the sender's public key file."""
    curve_allowed_clients_dir: str | None = None
    """ZeroMQ CURVE, sender side: directory of allowed client public key files."""

    def __post_init__(self) -> None:
        if not isinstance(self.transport_options, Mapping) or not all(
            isinstance(k, str) for k in self.transport_options
        ):
            raise ConfigError(f"transport_options must be a table (mapping of option names to values), "
                              f"got {self.transport_options!r}")
        object.__setattr__(self, "transport_options", TransportOptions(self.transport_options))
        _check_str("transport", self.transport)
        for name in ("default_tokens", "pool_tokens", "max_request_tokens", "max_rooms_per_peer", "copy_threads",
                     "max_senders", "max_concurrent_handshakes"):
            _check_int(name, getattr(self, name), 1, _MAX_INT)
        # The wire's own limits: a value past them validated here and then failed in every HELLO or STATUS.
        _check_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        _check_int("max_metadata_bytes", self.max_metadata_bytes, 1, MAX_METADATA_BYTES)
        # One missed PONG is ordinary timer lag: a limit of one interval declared live peers dead.
        _check_int("heartbeat_misses", self.heartbeat_misses, 2, _MAX_INT)
        if self.max_round_tokens is not None:
            _check_int("max_round_tokens", self.max_round_tokens, 1, _MAX_INT)
        _check_int("stream_chunk_tokens", self.stream_chunk_tokens, 0, _MAX_INT)
        _check_int("copy_chunk_tokens", self.copy_chunk_tokens, 0, _MAX_INT)
        _check_int("output_cache_bytes", self.output_cache_bytes, 0, _MAX_INT)
        _check_int("status_inline_bytes", self.status_inline_bytes, 0, MAX_INLINE_BYTES)
        _check_int("staging_tokens", self.staging_tokens, 0, _MAX_INT)
        _check_int("staging_max_tokens", self.staging_max_tokens, 1, _MAX_INT)
        if 0 < self.staging_tokens < self.staging_max_tokens:
            raise ConfigError(f"staging_max_tokens={self.staging_max_tokens} exceeds staging_tokens="
                              f"{self.staging_tokens}: a request that size could never be staged (allowed: "
                              "staging_max_tokens <= staging_tokens, or staging_tokens = 0 for no staging area)")
        for name in ("handshake_timeout", "input_timeout", "round_timeout", "room_timeout",
                     "heartbeat_interval", "sender_idle_timeout"):
            _check_seconds(name, getattr(self, name))
        if self.heartbeat_interval < MIN_HEARTBEAT_INTERVAL:
            raise ConfigError(f"heartbeat_interval={self.heartbeat_interval} is out of range; allowed: "
                              f"{MIN_HEARTBEAT_INTERVAL} <= heartbeat_interval <= 86400 seconds (a PING to every peer "
                              "that often keeps both event loops busy)")
        self._warn_contradictory_timeouts()
        bs = self.block_size
        if self.resume_reserve_tokens is not None:
            _check_int("resume_reserve_tokens", self.resume_reserve_tokens, 0, _MAX_INT)
            if self.default_tokens + self.resume_reserve_tokens > self.pool_tokens:
                raise ConfigError(
                    f"default_tokens={self.default_tokens} + resume_reserve_tokens={self.resume_reserve_tokens} "
                    f"exceeds pool_tokens={self.pool_tokens}: a first reservation could never be made")
        for name in ("default_tokens", "pool_tokens", "max_round_tokens", "resume_reserve_tokens"):
            value = getattr(self, name)
            if value is not None and value % bs:
                raise ConfigError(
                    f"{name}={value} must be a multiple of block_size={bs} "
                    f"(e.g. {math.ceil(value / bs) * bs})"
                )
        if self.pool_tokens // bs > MAX_POOL_BLOCKS:
            raise ConfigError(f"pool_tokens={self.pool_tokens} is {self.pool_tokens // bs} blocks of block_size={bs}; "
                              f"at most {MAX_POOL_BLOCKS} blocks (a larger block_size holds more)")
        if self.default_tokens > self.pool_tokens:
            raise ConfigError(
                f"default_tokens={self.default_tokens} exceeds pool_tokens={self.pool_tokens}: "
                "the pool must hold at least one default reservation"
            )
        if self.max_round_tokens is not None and self.max_round_tokens > self.pool_tokens:
            raise ConfigError(
                f"pool_tokens={self.pool_tokens} is smaller than one round "
                f"(max_round_tokens={self.max_round_tokens}); allowed: max_round_tokens <= pool_tokens"
            )
        largest = min(self.round_tokens, max(self.default_tokens, self.max_request_tokens))
        if -(-largest // bs) > MAX_BLOCKS_PER_MESSAGE:
            raise ConfigError(
                f"a reservation of up to {largest} tokens is {-(-largest // bs)} blocks of block_size={bs}, more "
                f"than one control message carries ({MAX_BLOCKS_PER_MESSAGE} block ids): every such room would "
                "fail; raise block_size, or lower max_round_tokens")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device={self.device!r} must be 'cpu', 'cuda' or 'cuda:N'")
        curve = (self.curve_secret_key_file, self.curve_server_public_key_file,
                 self.curve_allowed_clients_dir)
        for name, value in zip(("curve_secret_key_file", "curve_server_public_key_file",
                                "curve_allowed_clients_dir"), curve, strict=True):
            if value is not None:
                _check_str(name, value)
        if self.curve_secret_key_file is None:
            for name, value in (("curve_server_public_key_file", self.curve_server_public_key_file),
                                ("curve_allowed_clients_dir", self.curve_allowed_clients_dir)):
                if value is not None:
                    raise ConfigError(f"{name} is set but curve_secret_key_file is not: CURVE authentication "
                                      "would be off (it is on only with this side's secret key)")

    def _warn_contradictory_timeouts(self) -> None:
        """Timeouts that cannot take effect as written: valid (the earlier deadline wins), but likely not what
        was meant, so say so once per process and combination."""
        said = []
        whole = self.room_timeout
        for name in ("input_timeout", "round_timeout"):
            if getattr(self, name) > whole:
                said.append(f"{name}={getattr(self, name)} s exceeds room_timeout={whole} s: a room ends at "
                            f"room_timeout first")
        silence = self.heartbeat_interval * self.heartbeat_misses
        if silence >= whole:
            said.append(f"heartbeat_interval={self.heartbeat_interval} s x heartbeat_misses={self.heartbeat_misses} "
                        f"= {silence} s of silence before a peer is declared dead is not less than room_timeout="
                        f"{whole} s: rooms with a dead peer time out instead of failing as PeerDead")
        for line in said:
            if line not in _WARNED:
                _WARNED.add(line)
                log.warning("configuration: %s", line)

    @property
    def round_tokens(self) -> int:
        """Tokens reserved per resume round."""
        return self.max_round_tokens if self.max_round_tokens is not None else self.pool_tokens

    @property
    def resume_reserve(self) -> int:
        """Tokens of the pool kept for resume rounds (see ``resume_reserve_tokens``)."""
        if self.resume_reserve_tokens is not None:
            return self.resume_reserve_tokens
        eighth = self.pool_tokens // 8 // self.block_size * self.block_size
        return max(0, min(eighth, self.pool_tokens - self.default_tokens))

    @property
    def pool_blocks(self) -> int:
        """Number of blocks in the receive pool."""
        return self.pool_tokens // self.block_size

    @property
    def source(self) -> str | None:
        """Where these settings were read, as an error about them says it: ``in <file>`` (:meth:`from_toml`,
        :meth:`from_mapping`) or ``from the environment: AIOEMBED_...='...'`` (:meth:`from_env`); None for a
        config built in code. The transport's errors about ``transport_options`` name it: a plugin checks its
        options only when the endpoint opens, far from the file or variables they came from."""
        return self.__dict__.get("_source")

    def replace(self, **changes: Any) -> TransferConfig:
        """A copy with ``changes`` applied (and validated). It keeps :attr:`source` unless ``transport_options``
        is among the changes: options given here come from the caller, not from that file or environment."""
        out = dataclasses.replace(self, **changes)
        if self.source is not None and "transport_options" not in changes:
            out._set_source(self.source)
        return out

    def _set_source(self, source: str) -> None:
        object.__setattr__(self, "_source", source)  # not a field: equality, repr and asdict() stay the settings'

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "mapping") -> TransferConfig:
        """Build from a mapping of setting names, refusing unknown names. A bad value's error names ``source``
        (unless it is the default, ``"mapping"``)."""
        return cls._build(values, source, None if source == "mapping" else f"in {source}")

    @classmethod
    def _build(cls, values: Mapping[str, Any], source: str, origin: str | None) -> TransferConfig:
        """``cls(**values)``; a bad value's error, and the config's :attr:`source`, say ``origin``."""
        _check_names(values, f" in {source}")
        try:
            config = cls(**values)
        except ConfigError as exc:
            if origin is None:
                raise
            # Unknown names named the file; bad values did not, so a server reading one of several files, or
            # containers setting a few AIOEMBED_* variables, were told of a value with no word of where it was.
            raise ConfigError(f"{exc} ({origin})") from exc
        except TypeError as exc:  # pragma: no cover - dataclass signature errors
            raise ConfigError(f"bad settings in {source}: {exc}") from exc
        if origin is not None:
            config._set_source(origin)
        return config

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> TransferConfig:
        """Build from ``AIOEMBED_<SETTING>`` environment variables (e.g. ``AIOEMBED_DEFAULT_TOKENS``).

        ``AIOEMBED_TRANSPORT_OPTIONS`` takes a TOML inline table, e.g. ``{protocol = "tcp"}``.
        Keyword ``overrides`` win over the environment.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        known = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(cls)}
        for key in env:
            if key.startswith(ENV_PREFIX) and key not in known and not key.startswith(ENV_PREFIX + "TEST_"):
                log.warning("ignoring unknown environment variable %s (known: %s)", key, ", ".join(sorted(known)))
        read = []
        for f in dataclasses.fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key in env:
                values[f.name] = _parse_env(f.name, key, env[key])
                read.append(f"{key}={env[key]!r}")
        values.update(overrides)
        origin = f"from the environment: {', '.join(sorted(read))}" if read else None
        return cls._build(values, "environment", origin)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], **overrides: Any) -> TransferConfig:
        """Build from a TOML file: the ``[aioembed]`` table if present, else the top level."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read TOML config {p}: {exc}") from exc
        table = data.get("aioembed", data)
        if not isinstance(table, dict):
            raise ConfigError(f"[aioembed] in {p} must be a table, got {type(table).__name__}")
        if table is not data:
            known = {f.name for f in dataclasses.fields(cls)}
            outside = sorted(k for k in data if k != "aioembed" and k in known)
            if outside:
                raise ConfigError(f"setting(s) {outside} in {p} are outside its [aioembed] table, so they would "
                                  "be ignored: move them under [aioembed]")
        values = dict(table)
        values.update(overrides)
        return cls.from_mapping(values, source=str(p))


class TransportOptions(dict[str, Any]):
    """``TransferConfig.transport_options``: a read-only dict. A config is a value (frozen, shared between
    tasks and handed to plugins), and unlike a ``MappingProxyType`` this one pickles, deep-copies and goes
    through ``dataclasses.asdict`` (a config sent to a spawned worker process)."""

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("TransferConfig.transport_options is read-only; use TransferConfig.replace(transport_"
                        "options=...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))

    def __deepcopy__(self, memo: dict[int, Any]) -> TransportOptions:
        return type(self)(copy.deepcopy(dict(self), memo))

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted((k, _hashable(v)) for k, v in self.items())))


def _hashable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _check_names(settings: Mapping[str, Any], where: str) -> None:
    if not isinstance(settings, Mapping):  # a YAML/JSON document that is a list, a scalar or empty (None)
        raise ConfigError(f"settings{where} must be a table (mapping of setting names to values), got "
                          f"{type(settings).__name__}")
    known = {f.name for f in dataclasses.fields(TransferConfig)}
    unknown = sorted(set(settings) - known, key=repr)  # names of any type (a YAML key 8192 is an int)
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}{where}; known settings: {sorted(known)}")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range; allowed: {lo} <= {name} <= {hi}")


MIN_HEARTBEAT_INTERVAL = 0.01
"""Seconds: the least ``heartbeat_interval`` taken (the tests run at 0.05)."""


def _check_seconds(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{name} must be a number of seconds, got {value!r}")
    if not (0 < value <= 86400) or math.isnan(value):
        raise ConfigError(f"{name}={value} is out of range; allowed: 0 < {name} <= 86400 seconds")


def _check_str(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string, got {value!r}")


def _parse_env(name: str, key: str, raw: str) -> Any:
    default = {f.name: f for f in dataclasses.fields(TransferConfig)}[name]
    kind = str(default.type)
    try:
        if name == "transport_options":
            value = tomllib.loads(f"v = {raw}")["v"]
            if not isinstance(value, dict):
                raise ValueError("expected a TOML inline table such as {protocol = \"tcp\"}")
            return value
        if kind.startswith("int"):
            return None if raw.strip().lower() in ("", "none") else int(raw)
        if kind.startswith("float"):
            return float(raw)
        if "None" in kind and raw.strip().lower() in ("", "none"):
            return None
        return raw
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"environment variable {key}={raw!r} is not a valid {name}: {exc}") from exc
