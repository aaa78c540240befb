"""A dedicated Prefect server for benchmarks, like the test suite's: SQLite in a temp dir (the embedded default), or
a throw-away PostgreSQL cluster (a production server's database; tests/support/postgres_cluster.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

# Prefect's server keeps 5 (+10 overflow) database connections by default; a 64-input fan-out on a loaded machine
# waited out the 30 s checkout ("QueuePool limit of size 5 overflow 10 reached") and answered 500.
POSTGRES_SERVER_ENV = {
    "PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE": "20",
    "PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW": "40",
}


@contextlib.contextmanager
def prefect_server(database: str = "sqlite"):
    if database == "postgresql":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from postgres_cluster import postgres_cluster

        with postgres_cluster(durable=True) as url, _server(url) as home:
            yield home
        return
    with _server(None) as home:
        yield home


@contextlib.contextmanager
def _server(database_url: str | None):
    home = Path(tempfile.mkdtemp(prefix="kinetic-bench-"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_HOME": str(home / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url or f"sqlite+aiosqlite:///{home}/prefect.db",
        "KINETIC_CACHE_DIR": str(home / "kinetic-cache"),
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",  # standalone task calls are measured too
    }
    if database_url:
        env.update(POSTGRES_SERVER_ENV)
    os.environ.update(env)
    with open(home / "server.log", "wb") as log:  # the child writes through its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
    try:
        deadline = time.time() + 600  # minutes on a loaded machine: a first start migrates the database
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError((home / "server.log").read_text()[-2000:]) from None
                time.sleep(0.3)
        yield home
    finally:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
        proc.terminate()
        proc.wait(30)
