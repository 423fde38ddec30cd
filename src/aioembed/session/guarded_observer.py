"""The caller's :class:`~aioembed.metrics.TransferObserver`, called so that its exceptions cannot break a room.

The sessions call observer hooks in the middle of their bookkeeping: a room's end (before its source is let go and its
room id freed), a fence being applied to the pool (between two actions of one ledger step). A hook is the caller's
code (a metrics backend that is down, a bug in an exporter): had its exception gone through, a finished room would have
stayed registered for good, a ``send()`` whose bytes had landed would have raised a ``ValueError``, and a ledger step
would have been half applied to the pool. So each hook's exception is logged (one WARNING per hook and window, the
others at DEBUG: :class:`~aioembed.log_budget.WarningBudget`), counted in :attr:`GuardedObserver.failures`, and
dropped: the room goes on as if the hook had returned. Cancellation and other ``BaseException`` s pass through.
"""

from __future__ import annotations

import logging
from typing import Any

from aioembed.log_budget import WarningBudget
from aioembed.metrics import TransferObserver

__all__ = ["GuardedObserver"]

log = logging.getLogger("aioembed.metrics")


class GuardedObserver(TransferObserver):
    """``inner``'s hooks, each called inside ``try``/``except Exception`` (see the module docstring)."""

    def __init__(self, inner: TransferObserver) -> None:
        self.inner = inner
        self.failures = 0
        """Hook calls that raised (each logged)."""
        self._warnings = WarningBudget(log)

    def _call(self, hook: str, **kw: Any) -> None:
        try:
            getattr(self.inner, hook)(**kw)
        except Exception as exc:
            self.failures += 1
            self._warnings.warn(hook, "observer %s.%s raised %s: %s; ignored (the room goes on as if it had returned)",
                                type(self.inner).__name__, hook, type(exc).__name__, exc)
            log.debug("the observer's exception", exc_info=exc)

    def room_finished(self, *, side: str, outcome: str, nbytes: int, rounds: int, seconds: float) -> None:
        self._call("room_finished", side=side, outcome=outcome, nbytes=nbytes, rounds=rounds, seconds=seconds)

    def round_finished(self, *, side: str, seconds: float) -> None:
        self._call("round_finished", side=side, seconds=seconds)

    def sender_room_finished(self, *, sender: str, outcome: str, nbytes: int) -> None:
        self._call("sender_room_finished", sender=sender, outcome=outcome, nbytes=nbytes)

    def rows_inline(self, *, side: str, nbytes: int) -> None:
        self._call("rows_inline", side=side, nbytes=nbytes)

    def blocks_fenced(self, *, reason: str, blocks: int, sender: str) -> None:
        self._call("blocks_fenced", reason=reason, blocks=blocks, sender=sender)

    def fence_released(self, *, proof: str, blocks: int, sender: str) -> None:
        self._call("fence_released", proof=proof, blocks=blocks, sender=sender)

    def disconnect_probed(self, *, sender: str, verdict: str) -> None:
        self._call("disconnect_probed", sender=sender, verdict=verdict)

    def sender_closed(self, *, sender: str) -> None:
        self._call("sender_closed", sender=sender)

    def handshake_busy(self) -> None:
        self._call("handshake_busy")
