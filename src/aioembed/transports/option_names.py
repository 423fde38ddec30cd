"""Refusing ``transport_options`` keys a transport does not know, the same way in every transport.

Each transport (loopback, the plugins) refused an unknown key with its own copy of one message, listing what it
knows: a misspelt key (``tsl`` for ``tls``, ``protocl`` for ``protocol``) left the reader to find the near name in a
list of a dozen. The refusal now names it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from aioembed.errors import ConfigError

__all__ = ["refuse_unknown_options"]


def refuse_unknown_options(transport: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Raise :class:`ConfigError` if ``given`` holds names ``known`` lacks: ``unknown <transport> transport
    option(s) [...] (did you mean ...?); known: [...]``, the hint only for names close to a known one."""
    known_names = sorted(set(known))
    unknown = sorted(set(given) - set(known_names))
    if not unknown:
        return
    near = []
    for name in unknown:
        match = difflib.get_close_matches(name.strip().lower(), known_names, n=1, cutoff=0.6)
        if match:
            near.append(f"{match[0]!r} for {name!r}" if len(unknown) > 1 else repr(match[0]))
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ConfigError(f"unknown {transport} transport option(s) {unknown}{hint}; known: {known_names}")
