"""Run a kinetic task inside a flow on a background thread, so a test can act while the job runs."""

from __future__ import annotations

import threading
from typing import Any

from prefect import flow


def call_in_background(task: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """Start ``flow(task(*args))``; the returned dict gets ``value`` or ``error`` when it ends."""
    box: dict[str, Any] = {}

    @flow
    def pipeline():
        return task(*args)

    def target() -> None:
        try:
            box["value"] = pipeline()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box
