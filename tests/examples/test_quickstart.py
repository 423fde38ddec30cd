"""examples/quickstart.py runs as a user would run it and proves the transfer bit for bit."""

from __future__ import annotations

import subprocess
import sys

from .conftest import EXAMPLES, clean_env


def test_quickstart_runs_and_resumes() -> None:
    done = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True,
                          env=clean_env(), timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "tokens: 20000" in out
    assert "rounds: 2 (default reservation 8192 tokens)" in out  # 20000 > 8192: one resume
    assert "'model': 'quickstart'" in out
    assert "bit for bit: equal" in out
    assert "Traceback" not in done.stderr
