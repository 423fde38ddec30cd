"""A bad command-line flag of an example server is a one-line usage error (exit 2), not a traceback when the
server binds or configures logging (``--port 99999`` failed inside uvicorn, ``--log-level verbose`` inside
``logging.basicConfig``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import EXAMPLES, clean_env


@pytest.mark.parametrize(("script", "args", "env", "said"), [
    ("encoder_server.py", ["--port", "99999"], {}, "argument --port: 99999 is not a port (0..65535"),
    ("encoder_server.py", ["--log-level", "verbose"], {}, "argument --log-level: invalid choice: 'verbose'"),
    ("encoder_server.py", [], {"ENCODER_PORT": "eighty"}, "argument --port: 'eighty' is not a port number"),
    ("language_server.py", ["--port", "-1"], {}, "argument --port: -1 is not a port"),
    ("language_server.py", ["--log-level", "loud"], {}, "argument --log-level: invalid choice: 'loud'"),
    ("language_server.py", ["--chunk-tokens", "-1"], {}, "argument --chunk-tokens: -1 is not a number of tokens"),
    ("disaggregated_inprocess.py", ["--encoder-port", "65536"], {}, "argument --encoder-port: 65536 is not a port"),
])
def test_a_bad_flag_is_a_usage_error(script: str, args: list[str], env: dict[str, str], said: str) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=60, env=clean_env(**env), cwd=EXAMPLES.parent, check=False)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_log_level_is_case_insensitive() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLES / "encoder_server.py"), "--log-level", "INFO", "--help"],
                          capture_output=True, text=True, timeout=60, env=clean_env(), cwd=EXAMPLES.parent,
                          check=False)
    assert proc.returncode == 0 and "--log-level" in proc.stdout, proc.stderr


@pytest.mark.parametrize("script", ["encoder_server.py", "language_server.py"])
def test_a_misspelt_transport_option_is_refused_at_start_naming_the_file(script: str, tmp_path: Path) -> None:
    """Checked where the config is loaded (``check_transport_options``): before the model is built or anything
    served, with the near name and the file; not when the sender or receiver opens."""
    config = tmp_path / "bad.toml"
    config.write_text('[aioembed]\ntransport = "loopback"\n\n[aioembed.transport_options]\nthreds = 2\n')
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--config", str(config), "--port", "0"],
                          capture_output=True, text=True, timeout=60, env=clean_env(), cwd=EXAMPLES.parent,
                          check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "unknown loopback transport option(s) ['threds'] (did you mean 'threads'?)" in proc.stderr, proc.stderr
    assert f"(in {config})" in proc.stderr and "serving on" not in proc.stdout, (proc.stdout, proc.stderr)
