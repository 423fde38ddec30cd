"""Helpers for the tests of ``examples/``: import the example modules, run example servers as processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# The examples import each other as top-level modules (they are run as scripts from examples/).
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


@pytest.fixture
def anyio_backend() -> str:
    """uvicorn, and so the example servers, run on asyncio only."""
    return "asyncio"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``AIOEMBED_*`` settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOEMBED_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class ServerProcess:
    """An example server run as a subprocess, its output going to files (no pipe to fill up)."""

    def __init__(self, name: str, args: Sequence[str], env: Mapping[str, str], tmp: Path) -> None:
        self.name = name
        self.out_path = tmp / f"{name}.out"
        self.err_path = tmp / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.process = subprocess.Popen([sys.executable, str(EXAMPLES / args[0]), *args[1:]],
                                            stdout=out, stderr=err, env=dict(env), cwd=EXAMPLES.parent)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    async def wait_ready(self, timeout: float = 30.0) -> str:
        """The URL the server printed once it serves; fails with its stderr if it exits first."""
        with anyio.fail_after(timeout):
            while True:
                m = re.search(r"serving on (http://\S+)", self.stdout)
                if m:
                    return m.group(1)
                if self.process.poll() is not None:
                    pytest.fail(f"{self.name} exited with {self.process.returncode} before serving:\n"
                                f"{self.stdout}\n{self.stderr}")
                await anyio.sleep(0.05)

    def line(self, pattern: str) -> str:
        """The first group of ``pattern`` in the server's stdout."""
        m = re.search(pattern, self.stdout)
        assert m, f"{pattern!r} not in the output of {self.name}:\n{self.stdout}"
        return m.group(1)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send ``sig`` and wait for the exit code."""
        self.process.send_signal(sig)
        return await self.wait_exit(timeout)

    async def wait_exit(self, timeout: float = 20.0) -> int:
        """Wait for the process to end; its exit code."""
        with anyio.fail_after(timeout):
            while self.process.poll() is None:
                await anyio.sleep(0.05)
        return self.process.returncode

    def kill(self) -> None:
        """Make sure the process is gone (used on the way out of every test)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


@contextmanager
def server_processes() -> Iterator[list[ServerProcess]]:
    """A list to append servers to; every one is killed on exit, whatever happened."""
    procs: list[ServerProcess] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()


def assert_clean_exit(proc: ServerProcess, code: int) -> None:
    """Exit code 0, the shutdown line printed, and no traceback on stderr."""
    err = proc.stderr
    assert code == 0, f"{proc.name} exited with {code}:\n{err}"
    assert "Traceback" not in err, f"{proc.name} printed a traceback:\n{err}"
    assert "shutting down" in err
