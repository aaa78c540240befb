"""Riding out a Prefect API outage (a server restart, a dropped network) instead of failing a healthy job.

Prefect's client retries a failed request for about a minute and then raises, so a caller waiting for a
ten-minute job, or the worker following it, died with ``httpx.ConnectError`` when the server was away for
longer, and the job was then cancelled as if its caller had given up. Here a read or write that fails for a
reason that can pass is retried until the API answers again, for up to ``KINETIC_API_OUTAGE_SECONDS``
(``contract.API_OUTAGE_SECONDS_VAR``, default 15 minutes) counted from the first failure.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import prefect.context
from prefect.exceptions import PrefectHTTPStatusError
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES

from kinetic_prefect.contract import API_OUTAGE_SECONDS_VAR
from kinetic_prefect.contract.settings import API_OUTAGE_SECONDS

# A 503 from a busy SQLite server clears in milliseconds: only a failure that lasts is announced.
ANNOUNCE_AFTER_SECONDS = 3.0


def outage_horizon_seconds() -> float:
    """How long an unreachable Prefect API is waited out; a value that is not a number fails, naming the fix."""
    return API_OUTAGE_SECONDS.value()


def _to_stderr(text: str) -> None:
    print(f"kinetic-prefect: {text}", file=sys.stderr, flush=True)


class Outage:
    """The state of one caller's (or follower's) contact with the API, shared by all its calls, so an outage
    is announced once and its horizon is counted from its first failure, whichever call met it."""

    def __init__(self, what: str, notify: Callable[[str], None] = _to_stderr, horizon: float | None = None):
        self.what, self.notify = what, notify
        self.horizon = outage_horizon_seconds() if horizon is None else horizon
        self.since: float | None = None
        self.announced = False

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    async def call(self, make_call: Callable[[], Awaitable[Any]], doing: str) -> Any:
        """Await ``make_call()`` until it answers; transient failures are retried up to the horizon."""

        delay = 0.05
        while True:
            try:
                with _client_retries_off():
                    value = await make_call()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                now = time.monotonic()
                if self.since is None:
                    self.since = now
                if now - self.since > self.horizon:
                    exc.add_note(
                        f"kinetic-prefect: the Prefect API was unreachable for {now - self.since:.0f} s, "
                        f"longer than {API_OUTAGE_SECONDS_VAR}={self.horizon:.0f}"
                    )
                    raise
                if not self.announced and now - self.since >= ANNOUNCE_AFTER_SECONDS:
                    self.announced = True
                    self.notify(
                        f"the Prefect API cannot be reached while {doing} ({type(exc).__name__}: {exc}); "
                        f"{self.what} waits for it up to {self.horizon:.0f} s ({API_OUTAGE_SECONDS_VAR})"
                    )
                await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(5.0, delay * 2)
                continue
            if self.announced:
                away = time.monotonic() - (self.since or time.monotonic())
                self.notify(f"the Prefect API answers again after {away:.0f} s; {self.what} goes on")
            self.since, self.announced = None, False
            return value


__all__ = ["Outage", "outage_horizon_seconds"]


def is_transient(exc: BaseException) -> bool:
    """An API error that may pass by itself: a 5xx (e.g. SQLite busy under a fan-out), a dropped connection."""
    if isinstance(exc, PrefectHTTPStatusError):
        return exc.response.status_code >= 500 or exc.response.status_code == 429
    return isinstance(exc, (httpx.TransportError, ConnectionError))


_no_retry_settings: tuple[Any, Any] | None = None  # (settings, the same with the client's retries off)


def _client_retries_off() -> Any:
    """A settings context like the current one with Prefect's client retries off (``temporary_settings``
    builds a new Settings object each time, ≈ 25 ms; this one is rebuilt only when the settings change)."""
    global _no_retry_settings
    context = prefect.context.get_settings_context()
    cached = _no_retry_settings
    if cached is None or cached[0] is not context.settings:
        cached = (context.settings, context.settings.copy_with_update(updates={PREFECT_CLIENT_MAX_RETRIES: 0}))
        _no_retry_settings = cached
    return prefect.context.SettingsContext(profile=context.profile, settings=cached[1])
