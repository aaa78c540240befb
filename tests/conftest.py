"""Test session: a real Prefect server (SQLite, or PostgreSQL with ``--prefect-database=postgresql``) in its own
process, shared by all tests.

The API URL and the kinetic cache are set in the environment *before* any test module imports
Prefect (conftest is imported first), so this process, the job processes and the worker
processes the tests start all talk to the same server.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
# The tests live in one folder per room (tests/support/rooms.py) and their helpers in tests/support/. A test module
# imports a helper, or another room's fixtures and helpers, by module name: module names are unique across the
# folders (tests/house/test_rooms.py keeps them so), and every folder is on the path before the plugins load.
for _folder in [TESTS / "support", *sorted({path.parent for path in TESTS.glob("*/test_*.py")})]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

pytest_plugins = ["gcs_fixture", "docker_fixture", "worker_fixture", "kube_fixture", "rooms"]

SHARED = ROOT.parent / "shared"
_session_dir = Path(tempfile.mkdtemp(prefix="kinetic-tests-"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_PORT = _free_port()
os.environ.update(
    PREFECT_API_URL=f"http://127.0.0.1:{_PORT}/api",
    PREFECT_HOME=str(_session_dir / "prefect-home"),
    PREFECT_SERVER_ANALYTICS_ENABLED="false",
    PREFECT_LOGGING_TO_API_BATCH_INTERVAL="0.3",
    PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{_session_dir}/prefect.db",
    KINETIC_CACHE_DIR=str(_session_dir / "kinetic-cache"),
    # A task waiting for a tag-concurrency slot is told to come back after this (Prefect's default: 30 s); the
    # fan-out tests assert the limit, not Prefect's back-off, and spent most of their time in it.
    PREFECT_SERVER_TASKS_TAG_CONCURRENCY_SLOT_WAIT_SECONDS="1",
)
os.environ.pop("KINETIC_STORE", None)
os.environ.pop("KINETIC_WORK_POOL", None)


SLOW_TIER = bool(os.environ.get("KINETIC_SLOW_TESTS"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow_tier`` run only with ``KINETIC_SLOW_TESTS=1`` (CONTRIBUTING lists them)."""
    skip_slow = pytest.mark.skip(reason="slow tier: set KINETIC_SLOW_TESTS=1 (CONTRIBUTING lists what it adds)")
    for item in items:
        if item.get_closest_marker("slow_tier") is not None and not SLOW_TIER:
            item.add_marker(skip_slow)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--prefect-database",
        choices=["sqlite", "postgresql"],
        default="sqlite",
        help="the database of the session's Prefect server: SQLite (the embedded default) or a "
        "throw-away PostgreSQL cluster (a production server's; Debian's postgresql package)",
    )


@pytest.fixture(scope="session")
def prefect_database(request: pytest.FixtureRequest):
    """The server's database URL: SQLite in the session dir, or a PostgreSQL cluster started for the session."""
    if request.config.getoption("--prefect-database") == "sqlite":
        yield os.environ["PREFECT_API_DATABASE_CONNECTION_URL"]
        return
    from postgres_cluster import postgres_cluster

    with postgres_cluster() as url:
        os.environ["PREFECT_API_DATABASE_CONNECTION_URL"] = url
        # More than Prefect's 5 (+10) connections: a fan-out on a loaded machine waited out the 30 s checkout (500s).
        os.environ["PREFECT_SERVER_DATABASE_SQLALCHEMY_POOL_SIZE"] = "20"
        os.environ["PREFECT_SERVER_DATABASE_SQLALCHEMY_MAX_OVERFLOW"] = "40"
        yield url


class PrefectServerProcess:
    """The session's `prefect server start`, which a test may stop and start again on the same port and database
    (a real server restart: its in-memory state goes, what the database holds stays)."""

    def __init__(self, database_url: str):
        self.database_url = database_url
        self.proc: subprocess.Popen | None = None
        self.log_path = _session_dir / "prefect-server.log"
        self.outages: list[float] = []
        self._stopped_at: float | None = None

    @property
    def url(self) -> str:
        return os.environ["PREFECT_API_URL"]

    def start(self, timeout: float = 300) -> None:  # a fresh database's migrations took over 120 s at load 18
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(_PORT)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=os.environ.copy(),
            )
        from ui_check import wait_http  # imported here: it imports kinetic_prefect, which imports Prefect

        try:
            wait_http(f"http://127.0.0.1:{_PORT}/api/health", timeout, self.proc)
        except RuntimeError:
            self.proc.kill()
            raise RuntimeError(
                f"Prefect server did not start; see {self.log_path}:\n" + self.log_path.read_text()[-3000:]
            ) from None
        if self._stopped_at is not None:
            self.outages.append(time.time() - self._stopped_at)
            self._stopped_at = None

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._stopped_at = time.time()

    # the outage tests drive a server restart as they drive their TCP gate (api_gate.ApiGate)
    cut = stop
    restore = start


_server: PrefectServerProcess | None = None


@pytest.fixture(autouse=True)
def _prefect_server_unless_marked(request: pytest.FixtureRequest) -> None:
    """Every test gets the session's server unless its module says ``pytestmark = pytest.mark.no_server``: the
    static and pure-logic modules run alone (``pytest -m no_server``) without starting one. A module- or
    session-scoped fixture that talks to the API asks for ``prefect_server`` itself: it is set up before this one,
    and under xdist its module may be the first a worker runs."""
    if request.node.get_closest_marker("no_server") is None:
        request.getfixturevalue("prefect_server")


@pytest.fixture(scope="session")
def prefect_server(prefect_database):
    """`prefect server start` as a separate process; waits for /api/health."""
    global _server
    _server = PrefectServerProcess(prefect_database)
    _server.start()
    if prefect_database.startswith("postgresql"):
        from postgres_cluster import prefect_tables

        assert "flow_run" in prefect_tables(prefect_database), "the server did not make its tables in PostgreSQL"
    yield os.environ["PREFECT_API_URL"]
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # before the server goes, or the last batch fails to send
    _server.stop()


@pytest.fixture
def prefect_server_process(prefect_server) -> PrefectServerProcess:
    """The session's server process, for a test that restarts it."""
    assert _server is not None
    return _server


@pytest.fixture
def store_dir() -> Path:
    """The local artifact store the default pool uses in this session."""
    from kinetic_prefect import config

    return Path(config.default_store_url())


@pytest.fixture
def shared_data() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"{SHARED} is absent (it ships with the repository's CI machine only)")
    return SHARED / "data"
