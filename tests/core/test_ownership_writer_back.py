"""The block ledger: a doubt withdrawn must not take a real proof with it."""

from __future__ import annotations

import pytest

from aioembed.protocol.ownership import BlockLedger, FenceReason, Free, GrantState, Proof, Writer

W = Writer("p1", 1)


def _fenced(ledger: BlockLedger, reason: FenceReason) -> int:
    g = ledger.reserve("r", (0, 1))
    ledger.announce(g, W)
    ledger.fence(g, reason, now=0.0)
    return g


@pytest.mark.parametrize("proof", [Proof.DRAINED, Proof.FENCE_RELEASE, Proof.ABORT_ACK])
def test_writer_back_keeps_a_release_the_writer_itself_proved(proof: Proof) -> None:
    """A grant waits out the settle of a proof from its writer (DRAINED, FENCE_RELEASE, a late answer after a
    failed write); meanwhile the writer is taken for gone with a shorter lifetime, which replaced that release
    (one timed release per grant, the earliest). When it turns out not gone (``writer_back``), its release was
    withdrawn, and with it the proof's: the grant stayed fenced although its writer had proven it quiet, until
    some later proof (none comes for a FENCE_RELEASE in a session that lives on)."""
    ledger = BlockLedger()
    reason = FenceReason.SESSION_DROPPED if proof is Proof.DRAINED else FenceReason.WRITE_FAILED
    g = _fenced(ledger, reason)
    if proof is Proof.DRAINED:
        assert ledger.drained("p1", 2, now=0.0, settle=0.2) == []
    elif proof is Proof.FENCE_RELEASE:
        assert ledger.fence_released(W, "r", now=0.0, settle=0.2) == []
    else:
        assert ledger.late_answer(W, "r", Proof.ABORT_ACK, now=0.0, settle=0.2) == []
    assert ledger.next_deadline() == pytest.approx(0.2)
    assert ledger.writer_gone("p1", now=0.05, lifetime=0.1) == []  # wrongly: it is only unreachable
    ledger.writer_back("p1")  # it answers again
    assert ledger.tick(0.19) == []
    (free,) = ledger.tick(0.2)
    assert isinstance(free, Free) and free.grant == g and free.proof is proof


def test_writer_back_still_withdraws_a_release_resting_on_the_writer_being_gone() -> None:
    ledger = BlockLedger()
    g = _fenced(ledger, FenceReason.PEER_SILENT)
    ledger.writer_gone("p1", now=0.0, lifetime=5.0)
    ledger.writer_back("p1")
    assert ledger.next_deadline() is None
    assert ledger.tick(100.0) == [] and ledger.grant(g).state is GrantState.FENCED


def test_a_kept_release_restarts_after_a_loop_stall() -> None:
    ledger = BlockLedger()
    g = _fenced(ledger, FenceReason.WRITE_FAILED)
    ledger.fence_released(W, "r", now=0.0, settle=0.2)
    ledger.writer_gone("p1", now=0.05, lifetime=0.1)
    ledger.loop_stalled(0.1)  # the FENCE_RELEASE's window starts again: free at 0.3, not 0.2
    ledger.writer_back("p1")
    assert ledger.tick(0.29) == []
    (free,) = ledger.tick(0.31)
    assert isinstance(free, Free) and free.grant == g and free.proof is Proof.FENCE_RELEASE
