"""``transfer_timeout`` also shortens how long the engine keeps moving a failed write to a stalled peer.

The engine's TCP lanes drop a connection that makes no progress for ``MC_TCP_PROGRESS_TIMEOUT_SEC``
seconds, and read it for every transfer on their own threads. The plugin set it only around
``initialize()`` and restored it, so the engine never saw it: a write to a stopped peer raised at
``transfer_timeout`` (the plugin's own deadline) but its transfers ran on for the default 30 s, and the
sender kept the destination fenced that long plus ``write_lifetime``. It is now set for the process
while no engine of it exists (measured in a fresh process: the first engine of a process decides, until
the last one is gone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT = 5  # the engine's minimum transfer_timeout


def test_the_engine_drops_a_stalled_write_after_transfer_timeout() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_TCP_")}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("lane_timeout_proc.py")), str(TIMEOUT)],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["env"] == {"MC_TCP_PROGRESS_TIMEOUT_SEC": "5", "MC_TCP_STATUS_TIMEOUT_SEC": "5"}, out
    assert TIMEOUT - 0.5 <= out["raised_after"] < TIMEOUT + 3, out
    # The engine ends the stuck transfers after its progress timeout: 5 s, not its default 30.
    assert out["ended_after"] < TIMEOUT + 8, out
    # A second endpoint asking for another timeout does not change the process's (engine threads read it).
    assert out["env_after_second"] == "5" and len(out["warnings"]) == 2, out
