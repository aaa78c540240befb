"""The heartbeat an in-process caller keeps for its job on another machine (kinetic-vertex, kinetic-gke).

A kinetic-local job watches its caller's pid (runner ``watch_owner``); a custom job or a pod cannot see the calling
process. So while the calling process follows its job it rewrites the run's heartbeat record in the store
(``RunLayout.owner_heartbeat``), and the job's runner stops once the record has stayed unchanged for
``Env.OWNER_HEARTBEAT`` seconds (runner ``watch_heartbeat``): a caller killed with SIGKILL, or one whose machine
went away, leaves no machine billing until its deadline. A polling worker keeps no heartbeat: it outlives a call,
and one restarted reattaches.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any

from prefect.client.schemas.objects import FlowRun

from kinetic_prefect.contract import Env, RunLayout
from kinetic_prefect.shared import prefect_runs

# How long the job waits on an unchanged record before it stops: long enough for a store hiccup and a busy
# caller (six beats missed), short enough that a killed caller's accelerator bills minutes, not hours.
SILENCE_SECONDS = 90.0
BEATS_PER_SILENCE = 6


def owned_here(flow_run: FlowRun) -> bool:
    """True when the run is an in-process job of this very process (its owner labels name it): the caller runs the
    worker for its own call, and its job must not outlive it."""
    labels = flow_run.labels or {}
    mine = prefect_runs.owner_labels()
    return bool(labels) and all(str(labels.get(k, "")) == v for k, v in mine.items())


class Heartbeats:
    """One thread per launcher rewriting the records of every job this process follows (one small write per job
    per beat); a job is added before it is created and removed once it is no longer followed."""

    def __init__(self) -> None:
        self._records: dict[str, tuple[Any, str]] = {}  # run id -> (store, key)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._count = 0

    @staticmethod
    def silence_seconds() -> float:
        return SILENCE_SECONDS

    def job_env(self) -> dict[str, str]:
        """What tells the job to watch its record, and for how long a silence."""
        return {Env.OWNER_HEARTBEAT: f"{self.silence_seconds():g}"}

    def start(self, run_id: str, store: Any) -> None:
        """The first beat written now (the job, once up, finds a record), the next ones by the thread."""
        key = RunLayout(run_id).owner_heartbeat
        self._beat(store, key)
        with self._lock:
            self._records[run_id] = (store, key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kinetic-owner-heartbeat", daemon=True)
                self._thread.start()

    def stop(self, run_id: str) -> None:
        """No more beats for the run, and its record deleted (a job still running then stops too)."""
        with self._lock:
            found = self._records.pop(run_id, None)
        if found is not None:
            store, key = found
            with contextlib.suppress(Exception):  # the job stops after a silence either way
                store.delete(key)

    def following(self, run_id: str) -> bool:
        with self._lock:
            return run_id in self._records

    def _beat(self, store: Any, key: str) -> None:
        self._count += 1
        record = {"beat": self._count, "pid": os.getpid(), "at": time.time()}
        store.put_bytes(key, json.dumps(record).encode())

    def _run(self) -> None:
        interval = self.silence_seconds() / BEATS_PER_SILENCE
        while True:
            time.sleep(interval)
            with self._lock:
                records = list(self._records.values())
                if not records:
                    self._thread = None  # started again by the next job
                    return
            for store, key in records:
                with contextlib.suppress(Exception):  # a missed beat is one of six; the next one may pass
                    self._beat(store, key)


__all__ = ["SILENCE_SECONDS", "Heartbeats", "owned_here"]
