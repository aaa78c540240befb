"""Progress of a job, as Prefect shows it (stdlib only: it ships with the job runner).

    from kinetic_prefect.pod.progress import report
    for epoch in range(epochs):
        ...
        report(epoch + 1, epochs, f"epoch {epoch + 1}/{epochs} val_acc={acc:.3f}")

Each call prints one line (``contract.PROGRESS_PREFIX`` + JSON); the worker following the job turns
the latest one into a progress artifact on the job's flow run and a readable log line. Outside a
job the line is simply printed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kinetic_prefect.contract import PROGRESS_PREFIX


def line(done: float, total: float, message: str = "") -> str:
    """The progress line itself (workers log these for environment and image builds)."""
    return PROGRESS_PREFIX + json.dumps({"done": done, "total": total, "message": message})


def report(done: float, total: float, message: str = "") -> None:
    """Say that ``done`` of ``total`` units of work are finished."""
    print(line(done, total, message), file=sys.stdout, flush=True)


def parse(line: str) -> dict[str, Any] | None:
    """The progress record of a line, or None when the line is ordinary output."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        record = json.loads(line[len(PROGRESS_PREFIX) :])
        done, total = float(record["done"]), float(record["total"])
    except (ValueError, KeyError, TypeError):
        return None
    percent = 100.0 * done / total if total > 0 else 0.0
    return {
        "done": done,
        "total": total,
        "percent": max(0.0, min(100.0, percent)),
        "message": str(record.get("message") or ""),
    }
