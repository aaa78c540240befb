"""Polling ``prefect worker start --type kinetic-local`` processes for tests (a pytest plugin)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from prefect import get_client

PREFECT = [sys.executable, "-m", "prefect"]
# `prefect worker start` does not end on one SIGTERM: its handler turns the signal into a SIGINT to the worker,
# which the same handler takes as the first of two (the second sends SIGKILL); Prefect's own `process` worker does
# the same. Waiting for it to end after one signal cost every polling-worker test 30 s of teardown.
WORKER_STOP_GRACE_SECONDS = 3.0


def stop_worker_process(proc: subprocess.Popen) -> None:
    """End a `prefect worker start` process: SIGTERM, then SIGKILL after a short grace."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(WORKER_STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def prefect_cli(*args: str) -> str:
    proc = subprocess.run([*PREFECT, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def new_pool(prefix: str = "pool", worker_type: str = "kinetic-local") -> str:
    """As `prefect work-pool create NAME --type TYPE` does, through the API: the CLI's own start took over 120 s at
    a load average of 18."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.base import BaseWorker

    import kinetic_prefect.workers  # noqa: F401 - registers the kinetic worker types

    pool = f"{prefix}-{uuid.uuid4().hex[:6]}"
    template = BaseWorker.get_worker_class_from_type(worker_type).get_default_base_job_template()
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type=worker_type, base_job_template=template))
    return pool


class WorkerProcess:
    """One polling worker process on ``pool``; ``start`` again after ``kill`` is a restarted worker."""

    def __init__(self, pool: str, log_path: Path, env: dict[str, str] | None = None):
        self.pool, self.log_path = pool, log_path
        self.env = dict(env or {})  # e.g. PREFECT_API_URL through an api_gate.ApiGate
        self.proc: subprocess.Popen | None = None

    def start(self, wait_online: bool = True) -> WorkerProcess:
        env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5", **self.env}
        with open(self.log_path, "a") as log:  # the child writes through its own copy of the descriptor
            self.proc = subprocess.Popen(
                [
                    *PREFECT,
                    "worker",
                    "start",
                    "--type",
                    "kinetic-local",
                    "--pool",
                    self.pool,
                    "--name",
                    f"{self.pool}-worker",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        if wait_online:
            started = time.time()
            with get_client(sync_client=True) as client:
                while True:
                    workers = client.read_workers_for_work_pool(self.pool)
                    if any(
                        w.status.value == "ONLINE"
                        and w.last_heartbeat_time
                        and w.last_heartbeat_time.timestamp() >= started - 1
                        for w in workers
                    ):
                        break
                    assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
                    assert time.time() - started < 240, "worker never came online"  # minutes at load average 18
                    time.sleep(0.3)
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None:
            stop_worker_process(self.proc)


@pytest.fixture
def worker_factory(tmp_path):
    started: list[WorkerProcess] = []

    def make(pool: str | None = None, env: dict[str, str] | None = None) -> WorkerProcess:
        worker = WorkerProcess(pool or new_pool("polling"), tmp_path / f"worker-{len(started)}.log", env)
        started.append(worker)
        return worker

    yield make
    for worker in started:
        worker.stop()


@pytest.fixture(scope="session")
def _shared_worker(prefect_server, tmp_path_factory):
    worker = WorkerProcess(new_pool("shared-polling"), tmp_path_factory.mktemp("shared-worker") / "worker.log")
    yield worker
    worker.stop()


@pytest.fixture
def shared_polling_worker(_shared_worker) -> WorkerProcess:
    """One polling worker for the tests that only need one online (a start and stop cost each of them ≈ 8 s):
    started on first use, and again if a test's jobs took it down. A test that kills, restarts or reads the log of
    its worker takes its own from ``worker_factory``."""
    if _shared_worker.proc is None or _shared_worker.proc.poll() is not None:
        _shared_worker.start()
    return _shared_worker


@pytest.fixture
def polling_worker(worker_factory):
    worker = worker_factory().start()
    return worker.pool, worker.log_path
