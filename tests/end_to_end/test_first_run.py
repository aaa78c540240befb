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

ROOT = Path(__file__).resolve().parents[2]


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


_DECORATE_A_TYPO = """
import json, sys, time
from kinetic_prefect import kinetic_task

started = time.monotonic()
try:
    @kinetic_task(accelerator="l44")
    def train(x):
        return x
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
else:
    error = None
typo_s = time.monotonic() - started

started = time.monotonic()
@kinetic_task(accelerator="l4")
def fine(x):
    return x
valid_s = time.monotonic() - started

from prefect.server.api.server import SubprocessASGIServer

running = [port for port, server in SubprocessASGIServer._instances.items() if server.running]
print(json.dumps({"error": error, "typo_s": typo_s, "valid_s": valid_s, "running": running}))
"""


def test_decorating_checks_at_once_and_starts_no_server(tmp_path):
    """Issue 48, defect 8: with no PREFECT_API_URL, decorating used to start Prefect's temporary server (16-23 s)
    before checking anything, so `accelerator="l44"` was reported only after it. Now the typo is named at once
    (with the closest name), a valid decoration starts no server either, and nothing was made in PREFECT_HOME."""
    import json

    home = tmp_path / "home"
    home.mkdir()
    env = _bare_env(home)
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "60"  # a started server would be waited for
    env["PYTHONPATH"] = str(ROOT)  # this checkout's package, whatever the venv has installed
    script = tmp_path / "decorate.py"
    script.write_text(_DECORATE_A_TYPO)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["error"] and "Closest valid names: l4x4, l4," in report["error"], report
    assert report["typo_s"] < 5, report
    assert report["valid_s"] < 5, report
    assert report["running"] == [], report
    assert "Starting temporary server" not in output, output[-4000:]
    assert not list((tmp_path / "prefect-home").glob("*.db")), "a server made its database"


def test_cost_estimate_of_a_task_needs_no_server(tmp_path):
    """Issue 48, defect 8: `kinetic-prefect cost --estimate MODULE:TASK` imports the task's module; with no
    PREFECT_API_URL it used to wait 18-28 s for Prefect's temporary server that the estimate never uses.
    It needs a few seconds of imports on 2 loaded cores (why the bound is 8 s)."""
    home = tmp_path / "home"
    home.mkdir()
    env = _bare_env(home)
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "60"
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    (tmp_path / "estimated_flow.py").write_text(
        "from kinetic_prefect import kinetic_task\n\n\n"
        "@kinetic_task(accelerator=['a100x4', 'l4x4'])\ndef train(x):\n    return x\n"
    )
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "kinetic_prefect.cli", "cost", "--estimate", "estimated_flow:train", "--minutes", "30"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "a100x4" in output and "l4x4" in output, output[-4000:]
    assert "Starting temporary server" not in output, output[-4000:]
    assert elapsed < 8, f"{elapsed:.1f}s: {output[-2000:]}"
