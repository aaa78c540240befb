"""Caller side: Prefect's ephemeral local server, given a start-up limit that fits a first run (started when needed)."""

from __future__ import annotations

import os
from pathlib import Path

from kinetic_prefect.contract import settings
from kinetic_prefect.errors import KineticError

EPHEMERAL_STARTUP_SECONDS = settings.EPHEMERAL_STARTUP_SECONDS.default


def prepare_embedded_server() -> None:
    """Prepare Prefect's ephemeral local server for this process, without starting it: it starts when a flow or
    a call first needs Prefect's API, so decorating a task (and ``kinetic-prefect cost --estimate MODULE:TASK``,
    which imports the task's module) checks its options at once and waits for no server.

    With no ``PREFECT_API_URL``, Prefect starts a temporary server when a flow first needs the API, and gives it
    20 s. On a fresh machine the first start creates and migrates Prefect's SQLite database, which takes longer
    than that on 2 loaded cores: the README's first command failed with "Timed out while attempting to connect to
    ephemeral Prefect API server". So Prefect's own start-up limit is raised here, in the settings its later
    ``start()`` reads (``KINETIC_EPHEMERAL_STARTUP_SECONDS``, never lowered), and a ``PREFECT_HOME`` the server
    could not keep its database in is named now. Telemetry is off for this server only: on an offline machine it
    can only print errors. (This used to start the server here: 16-23 s at decoration, before a typo such as
    ``accelerator="l44"`` was reported; issue 48, defect 8.)
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, get_current_settings

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return
    _check_prefect_home()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # the subprocess reads it
    ephemeral = get_current_settings().server.ephemeral
    ephemeral.startup_timeout_seconds = max(
        ephemeral.startup_timeout_seconds, settings.EPHEMERAL_STARTUP_SECONDS.value()
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
