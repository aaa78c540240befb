"""Caller side: Prefect's ephemeral local server, started early with a start-up limit that fits a first run."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from kinetic_prefect.contract import settings
from kinetic_prefect.errors import KineticError

EPHEMERAL_STARTUP_SECONDS = settings.EPHEMERAL_STARTUP_SECONDS.default


def start_embedded_server() -> None:
    """Start Prefect's ephemeral local server now, with a start-up limit that fits a first run.

    With no ``PREFECT_API_URL``, Prefect starts a temporary server when a flow first needs the API,
    and gives it 20 s. On a fresh machine the first start creates and migrates Prefect's SQLite
    database, which takes longer than that on 2 loaded cores: the README's first command failed
    with "Timed out while attempting to connect to ephemeral Prefect API server". Prefect reads that
    limit from settings fixed when ``prefect`` is imported (before us), so instead the server is
    started here, at decoration time, with a longer limit (``KINETIC_EPHEMERAL_STARTUP_SECONDS``);
    Prefect's own later ``start()`` finds it running (it is one instance per process). Telemetry
    is off for this server only: on an offline machine it can only print errors.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    if server.running:
        return
    _check_prefect_home()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # the subprocess reads it
    timeout = settings.EPHEMERAL_STARTUP_SECONDS.value()
    started = time.monotonic()
    server.start(timeout=timeout)
    if time.monotonic() - started > 10:
        print(
            f"kinetic-prefect: Prefect's local server took {time.monotonic() - started:.0f}s to start "
            "(a first start creates its database). Run `prefect server start` in another terminal and "
            "set PREFECT_API_URL=http://127.0.0.1:4200/api to keep one running, with its UI.",
            file=sys.stderr,
            flush=True,
        )


def _check_prefect_home() -> None:
    """The local server keeps its SQLite database in PREFECT_HOME. Where that folder cannot be made or
    written (HOME missing or read-only, as in some containers), the server exits at start-up and
    Prefect waits out its whole start-up limit before a "Timed out ... ephemeral Prefect API server"
    that names nothing: say which folder and what to do, at once."""
    from prefect.settings import PREFECT_HOME

    home = Path(PREFECT_HOME.value()).expanduser()
    try:
        home.mkdir(parents=True, exist_ok=True)
        writable = os.access(home, os.W_OK)
        reason = "it is not writable"
    except OSError as exc:
        writable, reason = False, f"it cannot be created ({exc.strerror or exc})"
    if not writable:
        raise KineticError(
            f"Prefect's local server keeps its database in PREFECT_HOME={home}, but {reason}. "
            "Set PREFECT_HOME to a writable folder (or HOME to an existing, writable one), or point "
            "PREFECT_API_URL at a running server (`prefect server start`)."
        )
