"""A newcomer's first run: a fresh home, a fresh PREFECT_HOME, no server, no configuration.

The tests' own server (conftest) hides exactly this path, so it runs here in a subprocess with
an environment as bare as a new machine's. Prefect's own ephemeral start-up limit is lowered to
2 s to stand in for a slow first start (creating and migrating the SQLite database took longer
than Prefect's 20 s on 2 loaded cores): the first run must not depend on that limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_server

ROOT = Path(__file__).resolve().parent.parent


def _bare_env(home: Path) -> dict[str, str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "2",
    }
    for name in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):  # machine quirks, not configuration
        if name in os.environ:
            env[name] = os.environ[name]
    return env


@pytest.mark.slow
def test_a_kinetic_script_runs_on_a_fresh_machine(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = _bare_env(home)
    proc = subprocess.run(
        [sys.executable, "flows/hello_kinetic.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "job result {'loss': 0.125" in output, output[-4000:]
    assert "epoch 3/3 loss=0.1250" in output, "the job's output reaches the terminal"
    errors = [line for line in output.splitlines() if "| ERROR" in line or line.startswith("ERROR")]
    assert not errors, errors
    assert (home / ".prefect").is_dir() and (home / ".cache" / "kinetic-prefect" / "store").is_dir()


def test_a_home_prefect_cannot_write_is_named_at_once(tmp_path):
    """HOME under a plain file (so not even root can make ~/.prefect): the local server cannot create its
    database and exits. Prefect would wait out the whole start-up limit (5 minutes here) and then report
    a time-out naming nothing; the run must stop at once, naming PREFECT_HOME and the fix."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = _bare_env(blocker / "home")
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "flows/hello_kinetic.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert f"PREFECT_HOME={blocker / 'home' / '.prefect'}" in output, output[-4000:]
    assert "Set PREFECT_HOME to a writable folder" in output, output[-4000:]
    assert "Timed out" not in output, output[-4000:]
    assert time.monotonic() - started < 120, "it waited for a server that had already exited"
