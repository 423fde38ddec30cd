"""A child's event channel: what native libraries write to stdout never reaches the parent's event stream."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from aioembed.bench.event_channel import last_event, parse_event

CHILD = """
import os, sys
from aioembed.bench.event_channel import claim_stdout, emit
os.write(1, b"native before\\n")   # a library that printed before the claim
claim_stdout()
os.write(1, b"[ucp_context.c:1433] UCX  WARN  transports 'cuda_copy' are not available\\n")
print("a stray print")
emit(event="ready", pid=os.getpid())
os.write(1, b"{\\"looks\\": \\"like json\\"}\\n")
emit(event="done", id=1, value=2.5)
"""


def test_after_the_claim_stdout_carries_the_events_alone() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, timeout=60, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0] == b"native before"  # what came before the claim stays where it was
    assert [json.loads(x) for x in lines[1:]] == [{"event": "ready", "pid": json.loads(lines[1])["pid"]},
                                                   {"event": "done", "id": 1, "value": 2.5}]
    err = proc.stderr.decode()
    assert "UCX  WARN" in err and "a stray print" in err and '{"looks": "like json"}' in err


SCOPED = """
import os, sys
from aioembed.bench.event_channel import claimed_stdout
with claimed_stdout() as out:
    os.write(1, b"UCX  WARN  from a native library\\n")
    print("a stray print")
    out.write('{"report": 1}\\n')
print("stdout given back")
"""


def test_stdout_is_claimed_for_a_block_and_given_back() -> None:
    """``aioembed bench --json -``: the report alone on stdout while the bench runs, stdout as before after."""
    proc = subprocess.run([sys.executable, "-c", SCOPED], capture_output=True, timeout=60, check=True)
    assert proc.stdout.decode().splitlines() == ['{"report": 1}', "stdout given back"]
    assert "UCX  WARN  from a native library" in proc.stderr.decode() and "a stray print" in proc.stderr.decode()


def test_a_line_that_is_not_an_event_is_skipped_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="aioembed.bench.event_channel"):
        assert parse_event(b"[vm:1] UCX  WARN  transports 'cuda_copy' are not available", "peer") is None
        assert parse_event(b"[1, 2]", "peer") is None
        assert parse_event(b'{"event": "ready", "pid": 7}', "peer") == {"event": "ready", "pid": 7}
    assert [r.getMessage().startswith("peer wrote a line that is not an event") for r in caplog.records] == [True, True]


def test_the_last_event_of_a_finished_child_is_found_among_other_lines() -> None:
    out = b'native noise\n{"event": "ready"}\n{"result": 2}\n[exit] UCX  WARN  leak\n'
    assert last_event(out, "child") == {"result": 2}
    assert last_event(b"only noise\n", "child") is None
